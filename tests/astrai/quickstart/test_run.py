"""`astrai quickstart` in a reduced mode (batch 8 instead of 16, eager): the whole pipeline, and the accuracy it
must reach. Measured 98.7% on 300 held-out problems (docs/benchmarks.md); the bar leaves room for numerics."""

import io

from rich.console import Console

from astrai.io.model import load
from astrai.quickstart.run import QuickstartSettings, run_quickstart


def test_reduced_quickstart_learns_two_digit_addition(tmp_path):
    settings = QuickstartSettings(out_dir=tmp_path / "qs", batch_size=8, steps=800, eval_size=200, compile=False)
    out = io.StringIO()
    result = run_quickstart(settings, Console(file=out, width=200))
    text = out.getvalue()
    assert result.n == 200 and result.accuracy >= 0.9, text[-2000:]
    assert f"accuracy: {100 * result.accuracy:.1f}%" in text
    assert f"astrai serve --model {tmp_path / 'qs' / 'model'}" in text
    model = load(tmp_path / "qs" / "model")  # a plain HF folder with the chat tokenizer
    assert model.tokenizer is not None and model.tokenizer.chat_template
    assert (tmp_path / "qs" / "train" / "loss.png").is_file()
    # a second run reuses the saved model instead of training again
    again = io.StringIO()
    reused = run_quickstart(QuickstartSettings(out_dir=tmp_path / "qs", eval_size=50), Console(file=again, width=200))
    assert "reusing the trained model" in again.getvalue() and reused.n == 50
