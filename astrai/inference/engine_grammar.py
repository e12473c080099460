"""The engine's grammar methods (structured output): a mixin of `Engine`, apart from engine.py's request and step
machinery. The grammar engine itself is `astrai.inference.grammar`; `Engine.__init__` sets `self._grammar_lock` and
`self._grammar_view` (None until first built)."""

from __future__ import annotations

import threading

from astrai.inference.errors import EngineInputError
from astrai.inference.grammar import Grammar, GrammarError, TokenizerView, build_view, grammar_source
from astrai.inference.grammar_check import compile_checked
from astrai.inference.params import GrammarSpec
from astrai.io.model import Model


class GrammarMethods:
    """`Engine.compile_grammar` and `prepare_grammar`, over one tokenizer view built once (`_view`)."""

    model: Model
    _grammar_lock: threading.Lock
    _grammar_view: TokenizerView | None

    def compile_grammar(self, spec: GrammarSpec) -> Grammar:
        """Compile `spec` for this engine's tokenizer (cached on the view; the view is built on first use).

        `submit` calls it; the server calls it first on its worker pool, so `submit` finds it cached.

        Raises:
            EngineInputError: `param` is `spec.param`: the grammar does not compile, admits no complete output
                (`grammar_check`: an empty language, or a matcher that fails on the way), or the model has no
                tokenizer.
        """
        spec.check()
        try:
            return compile_checked(self._view(spec.param), grammar_source(spec), spec.closers)
        except GrammarError as err:
            raise EngineInputError(f"{spec.param}: {err}", param=spec.param) from None

    def prepare_grammar(self) -> bool:
        """Build the grammar engine's view of the tokenizer now (1.5-4 s at a 150k vocabulary), not on the first
        constrained request; `astrai serve` runs it on a thread at start. False when grammars are impossible
        (no tokenizer, no EOS token): the first constrained request then gets the 400 that says so."""
        try:
            self._view("grammar")
        except EngineInputError:
            return False
        return True

    def _view(self, param: str) -> TokenizerView:
        with self._grammar_lock:  # a request arriving while the view is built waits for it
            if self._grammar_view is None:
                if self.model.tokenizer is None:
                    raise EngineInputError("this model has no tokenizer: grammars need one", param=param)
                try:
                    self._grammar_view = build_view(self.model.tokenizer, vocab_size=self.model.config.vocab_size,
                                                    eos_token_ids=self.model.eos_token_ids or None)  # fmt: skip
                except ValueError as err:  # no EOS token: a grammar could never end its sequence
                    raise EngineInputError(str(err), param=param) from None
            return self._grammar_view
