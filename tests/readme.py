"""The examples of the README and of the pages in docs/, run as written:
their sections, their code blocks, and a shell that finds what their
commands name."""
import os
import re
import subprocess
import sys
from pathlib import Path

import zerocore

ROOT = Path(__file__).resolve().parents[1]


def section(title: str, page: str = "README.md") -> str:
    """The section of page (a path from the repository's root) whose heading
    is title, at any level, to the next heading of its level or above: a
    page's `# title` is the whole page."""
    text = (ROOT / page).read_text()
    heading = re.search(rf"^(#+) {re.escape(title)}$", text, re.M)
    assert heading, f"{page} has no heading {title!r}"
    end = re.compile(rf"^#{{1,{len(heading.group(1))}}} ", re.M).search(text, heading.end())
    return text[heading.start():end.start() if end else len(text)]


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
