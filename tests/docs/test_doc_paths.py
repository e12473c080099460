"""Model folders named in the docs are where the code writes them."""

import re
from pathlib import Path

from astrai.quickstart.run import QuickstartSettings

ROOT = Path(__file__).resolve().parents[2]


def test_serve_commands_name_the_quickstart_model_folder():
    model_dir = (QuickstartSettings().out_dir / "model").as_posix()
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in re.findall(r"astrai serve (?:--model )?(runs/quickstart\S*)", doc.read_text(encoding="utf-8")):
            found.append(path)
            assert path.rstrip("/") == model_dir, f"{doc.name}: `astrai serve {path}` is not the model ({model_dir})"
    assert found, "no doc shows how to serve the quickstart model"
