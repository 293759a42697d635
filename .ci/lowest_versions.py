"""Print pip requirements that pin the named dependencies of pyproject.toml to their lowest declared release series:
``python3 .ci/lowest_versions.py torch torchvision`` prints ``torch==2.11.* torchvision==0.26.*``. (A regular
expression, not tomllib: it runs on the Python 3.10 that pyproject.toml allows.)"""

import re
import sys
from pathlib import Path

pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
pins = []
for name in sys.argv[1:]:
    lowest = re.search(rf'^\s*"{re.escape(name)}(\[[^\]]*\])?\s*>=\s*([\d.]+)', pyproject, re.MULTILINE)[2]
    pins.append(f"{name}=={lowest}.*")
print(" ".join(pins))
