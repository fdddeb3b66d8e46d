"""The README and the pages in docs/: every relative link leads to a file
and heading that exist, nothing points outside the repository, the module
map of docs/architecture.md names every module of the package, and every
example runs as written: those the tests of their features run
(RUN_ELSEWHERE), and the rest here (EXAMPLES), on one gloo rank, after a
prelude that defines the few names each leaves to its reader (a model,
data, a loss), and followed by a check of what it did."""
import re
import socket
import subprocess
import sys
import textwrap

import pytest

import readme

PAGES = ["README.md", "tests/README.md", "bench/README.md",
         *sorted(str(p.relative_to(readme.ROOT)) for p in (readme.ROOT / "docs").glob("*.md"))]

# Pages whose examples the tests of their features run (through readme.py).
RUN_ELSEWHERE = {"docs/estimate.md": "test_estimate.py", "docs/deepspeed.md": "test_deepspeed_config.py",
                 "docs/hf-trainer.md": "test_hf_trainer.py", "docs/deterministic.md": "test_deterministic.py"}

GROUP = 'import torch, zerocore\ntorch.distributed.init_process_group("gloo")\n'
TINY_MODEL = ("torch.manual_seed(0)\n"
              "model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))\n")

# page: (the heading of the section whose python blocks run, then its bash
# blocks, in order; the prelude; the check after the python blocks).
EXAMPLES = {
    "README.md": ("The wrap loop", "import torch\n" + TINY_MODEL + """
data = [torch.randn(4, 8) for _ in range(3)]
val_batch = torch.randn(4, 8)
loss_fn = lambda out: out.float().pow(2).mean()
""", """
assert isinstance(model, torch.nn.Sequential) and step == len(data) - 1
assert torch.isfinite(val_loss) and (__import__("pathlib").Path("ckpt") / "0").is_dir()
"""),
    "docs/meta-init.md": ("Building big models: the meta device", GROUP + """
config = dict(d_model=16, nhead=2, dim_feedforward=32)

class GPT(torch.nn.Module):  # a user's model of torch's modules, whose reset_parameters zerocore replays
    def __init__(self, config):
        super().__init__()
        self.embed = torch.nn.Embedding(32, config["d_model"])
        self.blocks = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(**config) for _ in range(2))
        self.head = torch.nn.Linear(config["d_model"], 32)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)
""", """
torch.manual_seed(0)
eager = GPT(config)
with engine.gathered_params():
    assert all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), eager.parameters()))
engine(torch.randint(0, 32, (2, 8))).sum()
"""),
    "docs/checkpoint.md": ("Checkpoints", GROUP + TINY_MODEL + """
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
engine = zerocore.wrap(model, opt, zerocore.Config(stage=3))
scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
engine.step()
scheduler.step()
epoch = 3
saved = {k: v.clone() for k, v in engine.full_state_dict().items()}
""", """
assert extra == {"epoch": 3} and scheduler.last_epoch == 1
assert all(torch.equal(v, saved[k]) for k, v in engine.full_state_dict().items())
engine.close()
torch.distributed.destroy_process_group()
"""),
    "docs/offload.md": ("ZeRO-Offload", GROUP + TINY_MODEL, """
engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
engine.step()
assert engine.memory_report()["by_device"]["host"]["optim"] > 0
"""),
    "docs/snapshots.md": ("What a job adds", GROUP + TINY_MODEL + """
import os, shutil
os.environ["TORCHELASTIC_RUN_ID"] = f"docs-example-{os.getpid()}"  # torchrun's run id
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
total_steps = 2
batch, target = (lambda step: torch.randn(4, 8)), (lambda step: torch.zeros(4, 8))
loss_fn = torch.nn.functional.mse_loss
""", """
assert engine.restored_step == 0 and engine.step_count == total_steps
engine.close()
shutil.rmtree(f"/dev/shm/zerocore-snapshots/{os.environ['TORCHELASTIC_RUN_ID']}")
"""),
    "docs/activation-checkpoints.md": ("Using it", GROUP + """
tp_group = torch.distributed.group.WORLD
block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
x = torch.randn(4, 8, requires_grad=True)
""", """
y.sum().backward()
assert x.grad is not None and x.grad.shape == x.shape
"""),
}


def anchors(page: str) -> set:
    """GitHub's anchors of page's headings: lower case, punctuation but
    hyphens and underscores dropped, spaces as hyphens."""
    text = (readme.ROOT / page).read_text()
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_links_lead_to_files_and_headings(page):
    text = (readme.ROOT / page).read_text()
    here = (readme.ROOT / page).parent
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (here / path).resolve() if path else readme.ROOT / page
        assert resolved.is_relative_to(readme.ROOT), f"{page} links outside the repository: {target}"
        assert resolved.exists(), f"{page} links to a missing file: {target}"
        if anchor:
            assert anchor in anchors(str(resolved.relative_to(readme.ROOT))), f"{page}: no heading for {target}"


@pytest.mark.parametrize("page", PAGES)
def test_no_page_points_outside_the_repository(page):
    text = (readme.ROOT / page).read_text()
    assert not re.search(r"\.\./shared|/work/", text), page


def test_the_module_map_names_every_module():
    """docs/architecture.md's map is the one complete list of the package's
    modules: a module added without a line there fails here."""
    text = (readme.ROOT / "docs" / "architecture.md").read_text()
    package = readme.ROOT / "python" / "zerocore"
    modules = [p.relative_to(package) for p in package.rglob("*.py") if p.parent.name != "examples"]
    missing = [str(m) for m in modules if f"`{m.name}`" not in text and f"`{m}`" not in text]
    assert not missing, f"docs/architecture.md's module map does not name {missing}"


def test_every_example_runs_somewhere():
    """Every page with a python or bash block has its examples run: here
    (EXAMPLES) or by its feature's tests (RUN_ELSEWHERE)."""
    for page in PAGES:
        text = (readme.ROOT / page).read_text()
        if readme.blocks(text, "python") or readme.blocks(text, "bash"):
            assert page in EXAMPLES or page in RUN_ELSEWHERE, f"{page}'s examples run nowhere"
    for page, test in RUN_ELSEWHERE.items():
        assert f'"{page}"' in (readme.ROOT / "tests" / test).read_text(), f"{test} runs no example of {page}"


def run_on_one_rank(script: str, cwd) -> None:
    """Runs script in a fresh interpreter as rank 0 of a gloo group of one
    (the environment torchrun would set)."""
    env = dict(readme.environment(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "example ran" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("page", sorted(EXAMPLES))
def test_example_runs_as_written(page, tmp_path):
    title, prelude, check = EXAMPLES[page]
    section = readme.section(title, page)
    python, bash = readme.blocks(section, "python"), readme.blocks(section, "bash")
    assert python, f"{page}: no python example under {title!r}"
    script = textwrap.dedent(prelude) + "".join(python) + textwrap.dedent(check) + 'print("example ran")\n'
    run_on_one_rank(script, tmp_path)
    for shell in bash:  # after the python blocks, in the folder they wrote to
        readme.run_shell(shell, tmp_path)
