#!/usr/bin/env bash
# The package as a user gets it. `python -m build` makes the sdist and, from the sdist, the wheel
# (so a file the sdist lacks fails here); both hold what they should; the wheel installs into a
# new virtual environment (scripts/new_venv.sh: not the project's, no system site-packages, torch
# first) with the dependencies it declares, and works there without the repository: from a
# folder outside it, with `python -I`, it imports from that environment's site-packages, its
# version is the CHANGELOG's latest release, and Trainer(strategy="pipe_tp") resolves to
# PipeTPStrategy and fits a tiny model on one CPU process.
# .ci/run runs it after the test suite, with the project's environment first on PATH (it has
# `build`, from the [dev] extra). Every run starts from nothing; its folder is removed at exit.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! python -c "import build" 2>/dev/null; then
  echo "wheel_check: 'python -m build' is missing: run it in the project's environment (source scripts/venv.sh; FRESH_VENV=1 if that environment predates build in the [dev] extra)" >&2
  exit 1
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/lightning-pipe-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
start=$SECONDS

# Built from a copy of the files git sees (tracked, and new ones not ignored): an egg-info folder
# that an editable install left in the checkout would add its old file list to the sdist.
tree="$root"
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  tree="$work/tree"
  mkdir "$tree"
  git -C "$root" ls-files -z --cached --others --exclude-standard \
    | tar -C "$root" --null --files-from=- --ignore-failed-read -cf - 2>/dev/null | tar -C "$tree" -xf -
fi
if ! python -m build --outdir "$work/dist" "$tree" >"$work/build.log" 2>&1; then
  cat "$work/build.log" >&2
  exit 1
fi

# The version a release must carry: the CHANGELOG's latest "## [x.y.z] - date" heading.
version="$(python - "$root/CHANGELOG.md" <<'PY'
import re, sys
match = re.search(r"^## \[(\d+\.\d+\.\d+[^\]]*)\]", open(sys.argv[1]).read(), re.MULTILINE)
if match is None:
    sys.exit("wheel_check: CHANGELOG.md names no release (## [x.y.z] - date)")
print(match[1])
PY
)"

# What the archives hold: every file of the package on disk, py.typed, the license, the README.
python - "$tree" "$work/dist" "$version" <<'PY'
import sys, tarfile, zipfile
from email.parser import Parser
from pathlib import Path

root, dist, version = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
assert [p.name for p in sdists] == [f"lightning_pipe-{version}.tar.gz"], (sdists, version)
assert [p.name for p in wheels] == [f"lightning_pipe-{version}-py3-none-any.whl"], (wheels, version)
package = {
    p.relative_to(root).as_posix()
    for p in (root / "lightning_pipe").rglob("*")
    if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
}
assert "lightning_pipe/py.typed" in package

with tarfile.open(sdists[0]) as archive:
    top = f"lightning_pipe-{version}/"
    in_sdist = {m.name.removeprefix(top) for m in archive.getmembers() if m.isfile()}
wanted = package | {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "PKG-INFO", "MANIFEST.in"}
missing = sorted(wanted - in_sdist)
assert not missing, f"the sdist lacks {missing}"
stray = sorted(n for n in in_sdist if n.startswith("tests/") or n.endswith((".pyc", ".pyo")))
assert not stray, f"the sdist holds {stray}"

with zipfile.ZipFile(wheels[0]) as archive:
    in_wheel = set(archive.namelist())
    info = f"lightning_pipe-{version}.dist-info"
    metadata = Parser().parsestr(archive.read(f"{info}/METADATA").decode())
missing = sorted((package | {f"{info}/licenses/LICENSE"}) - in_wheel)
assert not missing, f"the wheel lacks {missing}"
stray = sorted(n for n in in_wheel if n.split("/")[0] not in ("lightning_pipe", info))
assert not stray, f"the wheel holds more than the package: {stray}"
assert metadata["Version"] == version, metadata["Version"]
for field in ("Requires-Python", "License-Expression", "Summary"):
    assert metadata[field], f"the wheel's METADATA has no {field}"
assert metadata["Description-Content-Type"] == "text/markdown"
print(f"wheel_check: {sdists[0].name} ({len(in_sdist)} files) and {wheels[0].name} ({len(in_wheel)} files)")
PY

bash "$root/scripts/new_venv.sh" "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "$work/dist/lightning_pipe-$version-py3-none-any.whl"
"$work/venv/bin/python" -m pip list 2>/dev/null | grep -E '^(torch|lightning|torchmetrics|lightning-pipe) '

mkdir "$work/elsewhere"
cd "$work/elsewhere"
env -u PYTHONPATH "$work/venv/bin/python" -I - "$version" "$root" <<'PY'
import importlib.metadata
import sys
import sysconfig
from pathlib import Path

version, repository = sys.argv[1], Path(sys.argv[2]).resolve()
import lightning_pipe  # noqa: E402

where = Path(lightning_pipe.__file__).resolve()
site = Path(sysconfig.get_paths()["purelib"]).resolve()
assert where.is_relative_to(site), f"lightning_pipe imported from {where}, not from {site}"
assert not any(Path(p or ".").resolve().is_relative_to(repository) for p in sys.path), sys.path
assert lightning_pipe.__version__ == version, (lightning_pipe.__version__, version)
assert importlib.metadata.version("lightning-pipe") == version
assert (where.parent / "py.typed").is_file()

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def configure_pipeline(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
trainer = L.Trainer(
    strategy="pipe_tp",
    accelerator="cpu",
    devices=1,
    max_steps=2,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
assert type(trainer.strategy) is lightning_pipe.PipeTPStrategy, type(trainer.strategy)
data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
trainer.fit(Tiny(), DataLoader(data, batch_size=4))
assert trainer.global_step == 2, trainer.global_step
print(f"wheel_check: lightning_pipe {version} from {where.parent}; pipe_tp -> PipeTPStrategy, 2 steps fitted")
PY
echo "wheel_check: passed in $((SECONDS - start)) s"
