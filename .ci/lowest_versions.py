"""Print pip requirements that pin the named dependencies of pyproject.toml to their lowest declared release series:
``python3 .ci/lowest_versions.py torch torchvision`` prints ``torch==2.11.* torchvision==0.26.*``."""

import re
import sys
import tomllib
from pathlib import Path

declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
pins = []
for name in sys.argv[1:]:
    spec = next(spec for spec in declared if re.match(rf"{re.escape(name)}\b(?![-\w])", spec))
    lowest = re.search(r">=\s*([\d.]+)", spec)[1]
    pins.append(f"{name}=={lowest}.*")
print(" ".join(pins))
