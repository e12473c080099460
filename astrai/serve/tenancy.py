"""What a request's tenant may see and share: its prefix-cache salt and whether usage reports cached tokens.

The prefix cache is shared by every request of a server; without care, `cached_tokens` (and the speed of a cache
hit) tells one client whether another sent a given prompt. Three controls, vLLM's names where vLLM has them:
- a request's own `cache_salt` (`SamplingParams.cache_salt`): only requests of the same salt share pages;
- `--cache-salt-by-api-key`: every request is salted by a hash of the API key it presented (combined with its own
  `cache_salt`), so clients holding different keys never share a page;
- `--enable-prompt-tokens-details` (off by default, as vLLM): only then does usage report `cached_tokens`.

`Guard` (astrai.serve.app) sets the request's `RequestContext` before routing; the handlers read it through
`salted` (when submitting to the engine) and `shows_cached_tokens` (when reporting usage). A context variable
carries it because it is per request and per server (several servers may live in one process, as in the tests).
"""

from __future__ import annotations

import contextvars
import hashlib

import attrs

from astrai.inference.params import SamplingParams


@attrs.frozen
class RequestContext:
    """A request's tenancy: `key_salt` (a hash of its API key; None: not salted by key) and whether its usage may
    report cached tokens."""

    key_salt: str | None = None
    show_cached_tokens: bool = True


_NO_TENANCY = RequestContext()  # outside a server's request (a frozen value: safe to share)
CURRENT: contextvars.ContextVar[RequestContext] = contextvars.ContextVar("astrai_request_context", default=_NO_TENANCY)


def key_salt(api_key: str) -> str:
    """The salt of an API key: a SHA-256 prefix (the key itself is never kept in the cache's keys)."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:32]


def salted(params: SamplingParams) -> SamplingParams:
    """`params` with the request's key salt joined to its own `cache_salt` (unchanged when not salted by key)."""
    salt = CURRENT.get().key_salt
    if salt is None:
        return params
    own = params.cache_salt
    return attrs.evolve(params, cache_salt=salt if own is None else f"{salt}|{own}")


def shows_cached_tokens() -> bool:
    """Whether this request's usage may report `cached_tokens` (`--enable-prompt-tokens-details`)."""
    return CURRENT.get().show_cached_tokens
