"""The README's usage example runs as written."""

from __future__ import annotations

import re
from pathlib import Path


def test_readme_usage_runs(capsys):
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    m = re.search(r"## Usage\n\n```python\n(.*?)```", text, re.S)
    assert m, "README.md has no '## Usage' python block"
    exec(compile(m.group(1), "README.md:Usage", "exec"), {})
    assert "tensor(" in capsys.readouterr().out
