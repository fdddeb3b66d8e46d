"""The README's examples, run as written: its sections, their code blocks,
and a shell that finds what the README's commands name."""
import os
import re
import subprocess
import sys
from pathlib import Path

import zerocore

README = Path(__file__).resolve().parents[1] / "README.md"


def section(title: str) -> str:
    """The README's section that starts with `## title`, to the next."""
    text = README.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def blocks(text: str, language: str) -> list:
    """The bodies of the ```language blocks in text."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


def environment() -> dict:
    """This process's environment, with this interpreter's folder first on
    PATH (torchrun, and the zerocore command where pip put one) and the
    zerocore under test importable."""
    package = str(Path(zerocore.__file__).parents[1])
    return dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
                PYTHONPATH=os.pathsep.join([package, os.environ.get("PYTHONPATH", "")]))


def run_shell(script: str, cwd, timeout: float = 300) -> str:
    """The stdout of `bash -e` running script in cwd, which must succeed."""
    run = subprocess.run(["bash", "-e", "-c", script], cwd=cwd, env=environment(), capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout
