"""Evaluation: `astrai eval TASK` (perplexity, multiple choice, HumanEval, IFEval, ROUGE, IFD) over a loaded model.

Each task module holds a frozen `Config` (its CLI flags) and an `evaluate(cfg, model=None) -> Report` callable
from Python; `report.py` prints the rich table, the JSON line and the per-sample file the same way for all.
Scoring runs a batched causal forward; generation goes through the inference engine. docs/evaluation.md.
"""
