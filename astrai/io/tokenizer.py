"""Tokenizer: a ``tokenizers.Tokenizer`` plus the checkpoint metadata around it (special tokens, chat template,
generation stop ids), loaded and saved in the Hugging Face folder layout.

``Tokenizer.from_dir`` reads ``tokenizer.json`` (required) and, when present, ``tokenizer_config.json``,
``special_tokens_map.json``, ``chat_template.jinja`` (+ ``additional_chat_templates/``), ``generation_config.json``
and ``config.json``. It applies the same load-time fix-ups transformers 5's ``TokenizersBackend`` does, so that
``encode``/``decode`` give the ids and text of ``AutoTokenizer.from_pretrained(path)``:
named special tokens missing from the added vocabulary are added as special; truncation and padding stored in
``tokenizer.json`` are ignored, and so are ``add_bos_token`` / ``add_eos_token`` (the post-processor in
``tokenizer.json`` decides whether BOS/EOS are added).

``train_tokenizer`` trains a small byte-level BPE locally (tests and the quickstart use it; no downloads).

Serving: ``encode_nogil`` gives ``encode``'s ids through the backend's batch path, which releases the GIL while
Rust works (``tokenizers``' ``encode`` holds it for the whole call: seconds for a multi-megabyte text), so a
worker thread tokenizing does not stop the event loop. ``encode_chat`` renders a conversation and encodes it so
that only the chat template's own text yields special tokens: special-token text sent by a client (a user writing
``<|im_end|>``) is encoded as plain text, as transformers' ``split_special_tokens`` would encode it.

Not here: slow (sentencepiece ``.model`` / ``vocab.txt``) tokenizers with no ``tokenizer.json``, the
WordPiece-era ``clean_up_tokenization_spaces`` post-processing, padding and truncation.
"""

from __future__ import annotations

import bisect
import copy
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers

from astrai.io.chat_template import (
    CHAT_TEMPLATE_DIR,
    CHAT_TEMPLATE_FILE,
    LiteralMarker,
    find_literals,
    load_chat_templates,
    render_chat_template,
    select_chat_template,
)
from astrai.io.detokenizer import IncrementalDetokenizer
from astrai.io.errors import CheckpointError
from astrai.io.tokenizer_files import eos_ids_from_model_files, read_side_json, token_str

# The named special tokens transformers exposes as template variables (``special_tokens_map``), in its order.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _fast_ids(backend: tokenizers.Tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    # the batch methods release the GIL while Rust works; `_fast` (tokenizers >= 0.21) skips computing offsets
    batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return batch([text], add_special_tokens=add_special_tokens)[0].ids


class Tokenizer:
    """Text <-> token ids, special tokens, chat template and stop ids for one checkpoint.

    Attributes:
        backend: the wrapped ``tokenizers.Tokenizer`` (mutating it changes this tokenizer).
        config: the ``tokenizer_config.json`` entries, kept so ``save`` writes them back (``model_max_length``,
            ``tokenizer_class``, ...).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        config: Mapping[str, Any] | None = None,
    ) -> None:
        """Wrap ``backend``.

        Args:
            backend: a ``tokenizers.Tokenizer``; named special tokens it lacks are added to it as special.
            special_tokens: ``{"bos_token": "<s>", "eos_token": ..., ...}`` (keys from ``SPECIAL_TOKEN_KEYS``).
            chat_template: one jinja2 template, or ``{name: template}`` with a ``"default"``.
            eos_token_ids: extra stop ids (from generation_config.json / config.json), highest priority first.
            config: other ``tokenizer_config.json`` entries to preserve on ``save``.
        """
        self.backend = backend
        self.config = {k: v for k, v in (config or {}).items() if k not in SPECIAL_TOKEN_KEYS}
        self.config.pop("chat_template", None)
        self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._chat_template = dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        self._extra_eos = tuple(eos_token_ids)
        self._add_missing_special_tokens([*self._special.values(), *self._extra_special_tokens()])

    def _extra_special_tokens(self) -> list[str]:
        # transformers 4 calls them additional_special_tokens (a list); 5 uses extra_special_tokens, a list or a
        # {name: token} dict of model-specific ones (e.g. "image_token").
        extra = self.config.get("extra_special_tokens") or []
        tokens = [
            *(self.config.get("additional_special_tokens") or []),
            *(extra.values() if isinstance(extra, dict) else extra),
        ]
        return [t for t in map(token_str, tokens) if t is not None]

    def _add_missing_special_tokens(self, tokens: Iterable[str]) -> None:
        # transformers adds every named special token that is not an added token (even if the model vocab has
        # it), which is what makes decode(skip_special_tokens=True) drop it.
        added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        missing = [t for t in dict.fromkeys(tokens) if t not in added]
        if missing:
            self.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face style checkpoint folder.

        Raises:
            FileNotFoundError: ``path/tokenizer.json`` does not exist.
            CheckpointError: (a ValueError) ``tokenizer.json`` or a JSON side file is corrupt (the message names it).
        """
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder} (slow tokenizers without one are unsupported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise CheckpointError(f"{tok_file} is not a valid tokenizers file: {e}") from e
        config = read_side_json(folder / "tokenizer_config.json")
        special = {k: token_str(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
        if backend.padding is not None and special["pad_token"] is None:
            special["pad_token"] = backend.padding["pad_token"]
        if "added_tokens_decoder" not in config:  # transformers reads this legacy file only in that case
            for key, value in read_side_json(folder / "special_tokens_map.json").items():
                if key in special and token_str(value) is not None:
                    special[key] = token_str(value)
        # transformers ignores stored truncation/padding unless asked for them at call time.
        backend.no_truncation()
        backend.no_padding()
        return cls(
            backend,
            special_tokens=special,
            chat_template=load_chat_templates(folder, config),
            eos_token_ids=eos_ids_from_model_files(folder),
            config=config,
        )

    # ---- encoding -------------------------------------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (e.g. a leading BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, never with a doubled BOS (what `astrai.generate` and the engine encode).

        ``encode``'s ids, except that when ``text`` already starts with the BOS token's text (rendered chat-template
        text: Llama 3's template writes ``<|begin_of_text|>`` itself) and the post-processor adds BOS in front of
        it, that added BOS is dropped, so the ids start with exactly one. transformers' ``tokenizer(text)`` and
        vLLM's completions route would keep both. ``add_special_tokens=False`` encodes the text as it is.
        """
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        bos, bos_text = self.bos_token_id, self.bos_token
        if add_special_tokens and bos is not None and bos_text and text.startswith(bos_text) and ids[:2] == [bos, bos]:
            del ids[0]
        return ids

    def encode_nogil(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``encode``'s ids, computed with the GIL released (what worker threads beside an event loop call).

        ``tokenizers.Tokenizer.encode`` holds the GIL for the whole call (seconds for megabytes of text); the
        backend's batch path releases it while Rust works.
        """
        return _fast_ids(self.backend, text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` over many texts (parallel in the Rust backend)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid or incomplete UTF-8 byte sequences come out as U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        """Size of the whole vocabulary including added tokens (``len(hf_tokenizer)``)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # ---- special tokens -------------------------------------------------------------------------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set, e.g. ``{"eos_token": "<|im_end|>", "pad_token": ...}``."""
        return {k: self._special[k] for k in SPECIAL_TOKEN_KEYS if k in self._special}

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of every added token marked special (what ``skip_special_tokens`` drops)."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def _special_id(self, key: str) -> int | None:
        token = self._special.get(key)
        return None if token is None else self.backend.token_to_id(token)

    bos_token = property(lambda self: self._special.get("bos_token"), doc="Beginning-of-sequence token or None.")
    eos_token = property(lambda self: self._special.get("eos_token"), doc="End-of-sequence token or None.")
    pad_token = property(lambda self: self._special.get("pad_token"), doc="Padding token or None.")
    unk_token = property(lambda self: self._special.get("unk_token"), doc="Unknown token or None.")
    bos_token_id = property(lambda self: self._special_id("bos_token"), doc="Id of ``bos_token`` or None.")
    eos_token_id = property(lambda self: self._special_id("eos_token"), doc="Id of ``eos_token`` or None.")
    pad_token_id = property(lambda self: self._special_id("pad_token"), doc="Id of ``pad_token`` or None.")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that stop generation: generation_config.json, then config.json, then ``eos_token``; deduped."""
        ids = [*self._extra_eos, self.eos_token_id]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    @property
    def special_token_texts(self) -> tuple[str, ...]:
        """Text of every added token marked special (what ``encode_chat`` keeps as text in client strings)."""
        return tuple(t.content for t in self.backend.get_added_tokens_decoder().values() if t.special)

    @functools.cached_property
    def _text_backend(self) -> tokenizers.Tokenizer:
        # a copy that encodes special-token text as text (transformers' split_special_tokens); toggling the flag
        # on the shared backend would race with other threads encoding. Built once: later changes to `backend`
        # do not reach it.
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of ``<0xNN>`` byte tokens when the decoder fuses them (sentencepiece ``byte_fallback``), else empty."""
        decoder = self.backend.decoder
        if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
            return frozenset()
        ids = (self.backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)

    @property
    def model_max_length(self) -> int | None:
        value = self.config.get("model_max_length")
        return value if isinstance(value, int) else None

    # ---- chat -----------------------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        """The default chat template (``"default"`` of several), or None."""
        if isinstance(self._chat_template, dict):
            return self._chat_template.get("default")
        return self._chat_template

    @property
    def chat_templates(self) -> dict[str, str]:
        """All chat templates by name (a single template is ``{"default": template}``)."""
        if isinstance(self._chat_template, dict):
            return dict(self._chat_template)
        return {} if self._chat_template is None else {"default": self._chat_template}

    def with_chat_template(self, chat_template: str | Mapping[str, str]) -> Tokenizer:
        """A copy that renders with ``chat_template`` (one template, or ``{name: template}``) instead of its own.

        The copy shares the backend; one template replaces all of this tokenizer's named ones (as vLLM's
        ``--chat-template`` does: it is used with and without tools).
        """
        new = copy.copy(self)
        new._chat_template = dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        return new

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation into a prompt, as transformers' ``apply_chat_template``.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``; assistant messages may carry ``tool_calls``.
            tools: JSON schemas of the available tools; selects a ``"tool_use"`` template when there is one.
            add_generation_prompt: end with the header that opens the assistant's turn (default True here,
                unlike transformers, because serving always wants it).
            tokenize: return token ids (encoded with ``add_special_tokens=False``) instead of text.
            chat_template: a template name from ``chat_templates`` or a whole template to use instead.
            **kwargs: more template variables (``documents``, ``continue_final_message``, ``enable_thinking``...);
                they override the special-token variables of the same name.

        Raises:
            ValueError: no chat template.
            ChatTemplateError: (a ValueError) the template failed to compile or render, rejected the conversation
                or passed a resource limit (its message is kept; ``astrai.io.chat_template``).
        """
        text = self._render(messages, tools, chat_template, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _render(self, messages: Sequence[Mapping[str, Any]], tools: Any, name: str | None, **variables: Any) -> str:
        template = select_chat_template(self._chat_template, name=name, tools=tools)
        return render_chat_template(template, messages, tools=tools, **{**self.special_tokens_map, **variables})

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        prefill: str = "",
        head: str = "",
        special_tokens_in_content: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Prompt ids of a conversation: the template rendered for generation, then ``prefill``, then ``head``.

        Only the template's own text (and ``head``) can produce special tokens: special-token text inside the
        client's strings (message contents, names, tool-call arguments, tool schemas, ``prefill``) is encoded as
        plain text, e.g. a user's ``<|im_end|>`` becomes ``<``, ``|``, ``im``, ... and cannot close its turn.
        A conversation whose strings hold no special-token text gets exactly
        ``encode(apply_chat_template(...) + prefill + head, add_special_tokens=False)``.

        Args:
            messages, tools, chat_template, **kwargs: as ``apply_chat_template`` (``add_generation_prompt`` is on).
            prefill: client text the reply continues (an assistant pre-fill), appended after the template.
            head: trusted text appended last (the opening of a forced tool call).
            special_tokens_in_content: encode the whole text as ``apply_chat_template(tokenize=True)`` does, so
                special-token text in client strings becomes control tokens (the behaviour before this policy).

        Raises:
            ValueError: no chat template, or the template failed or rejected the conversation
                (``ChatTemplateError``, a ValueError).
        """
        marker = LiteralMarker(() if special_tokens_in_content else self.special_token_texts)
        messages, tools, prefill = marker.hide(list(messages)), marker.hide(tools), marker.hide(prefill)
        text = self._render(messages, tools, chat_template, add_generation_prompt=True, **kwargs) + prefill + head
        if not marker.hits:
            return self.encode_nogil(text, add_special_tokens=False)
        return self._encode_protected(*marker.reveal(text))

    def _encode_protected(self, text: str, starts: Sequence[int], ends: Sequence[int]) -> list[int]:
        """Ids of ``text`` in which special tokens matched inside the client-text spans ``starts[k]:ends[k]``
        (sorted, disjoint) are encoded as text.

        The tokenizer splits text at added tokens before its pre-tokenizer and model run, so the stretch between
        two of the template's special tokens is encoded on its own; each stretch holding an injected match is
        encoded again with special-token matching off and spliced in. (A Metaspace pre-tokenizer with
        ``prepend_scheme="first"`` then sees that stretch as a first piece and prefixes it with a space.)
        """
        ids, special = self.encode_nogil(text, add_special_tokens=False), self.special_token_ids
        marks = [i for i, t in enumerate(ids) if t in special]
        where = self._special_spans(text, [ids[i] for i in marks])
        if where is None:  # the tokenizer's own offsets: exact, but computing them triples the encode time
            enc = self.backend.encode_batch([text], add_special_tokens=False)[0]
            where = [enc.token_to_chars(i)[0] for i in marks], [enc.token_to_chars(i)[1] for i in marks]
        los, his = where
        bad = {k for k in range(len(marks))
               if (j := bisect.bisect_right(ends, los[k])) < len(starts) and starts[j] < his[k]}  # fmt: skip
        real = [k for k in range(len(marks)) if k not in bad]
        # stretches holding an injected token, as the numbers of the real special tokens around them (-1 and
        # len(marks) for the text's ends)
        runs = sorted({(real[j - 1] if j else -1, real[j] if j < len(real) else len(marks))
                       for j in (bisect.bisect_left(real, k) for k in bad)})  # fmt: skip
        out, pos = [], 0
        for before, after in runs:
            lo, first = (his[before], marks[before] + 1) if before >= 0 else (0, 0)
            hi, end = (los[after], marks[after]) if after < len(marks) else (len(text), len(ids))
            out += ids[pos:first] + _fast_ids(self._text_backend, text[lo:hi], add_special_tokens=False)
            pos = end
        return out + ids[pos:]

    def _special_spans(self, text: str, found_ids: Sequence[int]) -> tuple[list[int], list[int]] | None:
        """Where the special tokens ``found_ids`` (in order) start and end in ``text``, from a literal scan.

        None where the scan may disagree with the tokenizer: special tokens that strip whitespace, match whole
        words or normalized text, or a scan that finds other tokens than the tokenizer did.
        """
        added = [t for t in self.backend.get_added_tokens_decoder().values() if t.special]
        if any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added):
            return None
        token_id = {t.content: self.backend.token_to_id(t.content) for t in added}
        los, his, scanned = [], [], []  # flat int lists: see LiteralMarker.reveal
        for match in find_literals(text, tuple(token_id)):
            los.append(match.start())
            his.append(match.end())
            scanned.append(token_id[match.group()])
        return (los, his) if scanned == list(found_ids) else None

    def detokenizer(
        self, *, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer over this tokenizer (see ``astrai.io.detokenizer``)."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)

    # ---- saving ---------------------------------------------------------------------------------------------
    def _config_to_save(self) -> dict[str, Any]:
        # transformers 5 ignores (and never writes) add_bos/eos_token when tokenizer.json exists: the
        # post-processor stored there decides. Dropping them keeps older loaders from second-guessing it.
        config = {k: v for k, v in self.config.items() if k not in ("add_bos_token", "add_eos_token")}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config.setdefault("clean_up_tokenization_spaces", False)  # decode() never does WordPiece clean-up
        config["added_tokens_decoder"] = {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }
            for i, t in sorted(self.backend.get_added_tokens_decoder().items())
        }
        config.update({k: self._special.get(k) for k in SPECIAL_TOKEN_KEYS if k in self._special})
        if isinstance(self._chat_template, dict):
            config["chat_template"] = [{"name": k, "template": v} for k, v in self._chat_template.items()]
        elif self._chat_template is not None:
            config["chat_template"] = self._chat_template
        return config

    def save(self, out_dir: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` loadable by ``from_dir`` and transformers.

        The chat template(s) go into ``tokenizer_config.json``. A ``chat_template.jinja`` or
        ``additional_chat_templates/*.jinja`` already in ``out_dir`` would shadow them, so those are deleted.
        ``generation_config.json`` is the model's to write.
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        text = json.dumps(self._config_to_save(), indent=2, ensure_ascii=False) + "\n"
        (out / "tokenizer_config.json").write_text(text, encoding="utf-8")
        (out / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
        if (out / CHAT_TEMPLATE_DIR).is_dir():
            for stale in (out / CHAT_TEMPLATE_DIR).glob("*.jinja"):
                stale.unlink()

    def __repr__(self) -> str:
        has_template = self.chat_template is not None
        return f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}, chat_template={has_template})"


def train_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int,
    special_tokens: Sequence[str] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    eos_token: str = "<|im_end|>",
    bos_token: str | None = None,
    pad_token: str | None = "<|endoftext|>",
    chat_template: str | None = None,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 / Qwen style) on ``texts``, locally and deterministically.

    Any byte sequence is encodable (the 256 byte symbols are always in the vocabulary), so the result can
    tokenize text outside its training corpus (CJK, emoji) at the cost of longer sequences.

    Args:
        texts: training corpus.
        vocab_size: target size including the 256 byte symbols and the special tokens.
        special_tokens: added tokens (ids 0..n-1); ``eos_token``/``bos_token``/``pad_token`` are appended if absent.
        eos_token, bos_token, pad_token: the named special tokens (None for none).
        chat_template: a jinja2 chat template to attach.
    """
    specials = list(dict.fromkeys([*special_tokens, *(t for t in (eos_token, bos_token, pad_token) if t)]))
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    special = {"eos_token": eos_token, "bos_token": bos_token, "pad_token": pad_token}
    return Tokenizer(backend, special_tokens=special, chat_template=chat_template)
