"""Real chat templates for the tool-call and reasoning parser tests, read out of a pinned PyPI sdist.

llama.cpp keeps models' own Hugging Face chat templates under `models/templates/` (fetched from each model's
tokenizer_config by its `scripts/get_chat_template.py`), and the `llama-cpp-python` sdist vendors llama.cpp,
templates included. `make test` runs this file once (`python3 tests/real_templates.py`): it downloads the pinned
sdist from PyPI into `.cache/` (ignored by git) and checks its sha256. Tests never download: they read the
templates straight out of the tarball with `tarfile` (`load`), and nothing of the templates is copied into this
repository. Only the standard library is used, so the download runs before the venv exists.
"""

from __future__ import annotations

import hashlib
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "0.3.36"  # 76.6 MB; every template the tests name is in it
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
URL = (
    "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
    f"llama_cpp_python-{VERSION}.tar.gz"
)
SDIST = Path(__file__).resolve().parent.parent / ".cache" / f"llama_cpp_python-{VERSION}.tar.gz"
FOLDER = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/templates/"
SOURCE = f"llama.cpp's models/templates in the llama-cpp-python {VERSION} sdist (PyPI, sha256 {SHA256[:12]}...)"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(path: Path = SDIST) -> None:
    """Download the pinned sdist to `path` unless a file with the right checksum is there already."""
    if path.exists() and _sha256(path) == SHA256:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    print(f"downloading {URL} -> {path}", file=sys.stderr)
    with urllib.request.urlopen(URL, timeout=300) as response, part.open("wb") as out:
        while block := response.read(1 << 20):
            out.write(block)
    got = _sha256(part)
    if got != SHA256:
        part.unlink()
        raise SystemExit(f"{URL}: sha256 {got}, expected {SHA256}")
    part.replace(path)


def load(names: list[str], path: Path = SDIST) -> dict[str, str]:
    """name -> template text for each `models/templates/NAME.jinja` in the sdist at `path` (checksum-checked).

    Raises:
        FileNotFoundError: the sdist is not there (run `python3 tests/real_templates.py`).
        ValueError: its checksum is not the pinned one, or a named template is missing from it.
    """
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make test-data` (python3 tests/real_templates.py)")
    if _sha256(path) != SHA256:
        raise ValueError(f"{path}: not the pinned llama-cpp-python {VERSION} sdist (sha256 differs)")
    wanted, out = {FOLDER + n + ".jinja": n for n in names}, {}
    with tarfile.open(path, "r:gz") as tar:
        for member in tar:  # streamed: stop once every template is read (they sit together, ~60% in)
            if member.name in wanted:
                out[wanted[member.name]] = tar.extractfile(member).read().decode("utf-8")
                if len(out) == len(wanted):
                    break
    missing = sorted(set(names) - set(out))
    if missing:
        raise ValueError(f"{path} has no template {', '.join(missing)} under {FOLDER}")
    return out


if __name__ == "__main__":
    fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else SDIST)
