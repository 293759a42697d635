"""Print pip requirements that pin every direct dependency of pyproject.toml (its ``dependencies`` and the
``export`` extra) to the lowest version it allows: ``python3 .ci/lowest_versions.py`` prints ``torch==2.11
torchvision==0.26 lightning==2.6 ...`` (pip reads ``==2.11`` as 2.11.0). With names, only those:
``python3 .ci/lowest_versions.py torch torchvision``. (A regular expression, not tomllib: it runs on the
Python 3.10 that pyproject.toml allows.)"""

import re
import sys
from pathlib import Path

pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
declared = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.MULTILINE | re.DOTALL)[1]
declared += re.search(r"^export = \[(.*?)\]", pyproject, re.MULTILINE)[1]
floors = dict(re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*>=\s*([\d.]+)', declared))
names = sys.argv[1:] or list(floors)
print(" ".join(f"{name}=={floors[name]}" for name in names))
