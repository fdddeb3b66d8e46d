"""The README and the pages in docs/: every relative link leads to a file
and heading that exist, nothing points outside the repository, and the
examples no other test runs (the README's wrap loop, the meta-device
build) run as written, on one gloo rank, around the few names each leaves
to its reader (a model, data, a loss)."""
import re
import subprocess
import sys
import textwrap

import pytest

import readme

PAGES = ["README.md", "tests/README.md", "bench/README.md",
         *sorted(str(p.relative_to(readme.ROOT)) for p in (readme.ROOT / "docs").glob("*.md"))]


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


def run_on_one_rank(prelude: str, example: str, cwd) -> str:
    """The stdout of prelude then example, run by a fresh interpreter as
    rank 0 of a gloo group of one (the env torchrun would set)."""
    script = textwrap.dedent(prelude) + example
    env = dict(readme.environment(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_wrap_loop_runs_as_written(tmp_path):
    [loop] = readme.blocks(readme.section("The wrap loop"), "python")
    prelude = """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        data = [torch.randn(4, 8) for _ in range(3)]
        val_batch = torch.randn(4, 8)
        loss_fn = lambda out: out.float().pow(2).mean()
    """
    check = """
assert isinstance(model, torch.nn.Sequential) and step == len(data) - 1
assert torch.isfinite(val_loss) and (__import__("pathlib").Path("ckpt") / "0").is_dir()
print("trained")
"""
    assert "trained" in run_on_one_rank(prelude, loop + check, tmp_path)


def test_the_meta_device_example_runs_as_written(tmp_path):
    [example] = readme.blocks(readme.section("Building big models: the meta device", "docs/meta-init.md"), "python")
    prelude = """
        import torch, zerocore
        torch.distributed.init_process_group("gloo")
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
    """
    check = """
torch.manual_seed(0)
eager = GPT(config)
with engine.gathered_params():
    assert all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), eager.parameters()))
engine(torch.randint(0, 32, (2, 8))).sum()
print("materialised")
"""
    assert "materialised" in run_on_one_rank(prelude, example + check, tmp_path)
