"""StopStringMatcher: stops across feeds, overlapping stops, released partial matches, and a property test
against the reference `text[:text.find(stop)]` for random texts split at random points."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.inference.stop import StopStringMatcher


def _is_proper_prefix(text, stops):
    return any(s.startswith(text) and s != text for s in stops)


def _run(stops, pieces, *, include_stop=False):
    """Feed `pieces`; return (emitted text, stopped, per-feed emissions).

    Also checks that, until a stop, the held-back text is exactly the longest suffix of the text so far that could
    still start a stop string: nothing is held that can't be part of a stop.
    """
    m = StopStringMatcher(stops, include_stop=include_stop)
    emitted, stopped, seen = [], False, ""
    for piece in pieces:
        text, stopped = m.feed(piece)
        emitted.append(text)
        seen += piece
        if not stopped:
            held = seen[len("".join(emitted)) :]
            assert seen.startswith("".join(emitted))
            assert held == "" or _is_proper_prefix(held, stops), f"holds {held!r}"
            longer = [seen[i:] for i in range(len(seen) - len(held)) if _is_proper_prefix(seen[i:], stops)]
            assert not longer, f"emitted {longer[0]!r} which could still start a stop"
    if not stopped:
        emitted.append(m.flush())
    return "".join(emitted), stopped, emitted


def _reference(text, stops, include_stop=False):
    """Plain scan: the first end position where some stop is complete; the longest such stop wins."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[: end if include_stop else end - len(stop)], True
    return text, False


def test_stop_split_across_many_feeds():
    text, stopped, emitted = _run(["<|end|>"], ["Hello", " world", "<", "|e", "n", "d|", ">", "ignored"])
    assert (text, stopped) == ("Hello world", True)
    assert emitted[:2] == ["Hello", " world"] and emitted[2:6] == ["", "", "", ""]
    assert emitted[7] == ""  # later feeds after the stop emit nothing


def test_partial_match_is_released_when_it_turns_out_not_to_be_a_stop():
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("P!") == ("", True) and m.matched == "STOP"
    assert StopStringMatcher(["aXb"]).feed("aa") == ("a", False)
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", False)
    assert m.feed("OR") == ("STOR", False)
    assert m.feed("ST") == ("", False)
    assert m.flush() == "ST" and m.flush() == ""


def test_overlapping_prefix_stops():
    # "ab" completes before "abc" could: it wins whichever way the text is split
    assert _run(["abc", "ab"], ["xabc"])[:2] == ("x", True)
    assert _run(["abc", "ab"], ["x", "a", "b", "c"])[:2] == ("x", True)
    assert _run(["abc", "ab"], ["xabc"], include_stop=True)[:2] == ("xab", True)
    # the earliest *ending* occurrence wins: "c" ends before "bcd"
    assert _run(["bcd", "c"], ["abcd"])[:2] == ("ab", True)
    # same end: the longer (earlier starting) stop wins
    assert _run(["bc", "abc"], ["xabcx"], include_stop=True)[:2] == ("xabc", True)
    # a self-overlapping stop: "aab" inside "aaab"
    assert _run(["aab"], ["a", "a", "a", "b"])[:2] == ("a", True)


def test_several_stops_earliest_wins_and_include_stop():
    assert _run(["END", "\n\n"], ["one\n", "\ntwo END"])[:2] == ("one", True)
    assert _run(["END", "\n\n"], ["one END", "\n\n"], include_stop=True)[:2] == ("one END", True)


def test_unicode_and_no_stop():
    assert _run(["。"], ["你好", "世界。", "再见"])[:2] == ("你好世界", True)
    assert _run(["🙂🙃"], ["a🙂", "b🙂", "🙃c"], include_stop=True)[:2] == ("a🙂b🙂🙃", True)
    assert _run([], ["plain ", "text"]) == ("plain text", False, ["plain ", "text", ""])
    assert _run(["zz"], ["abc z"]) == ("abc z", False, ["abc ", "z"])


def test_rejects_empty_stop():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


def _splits(text):
    return st.lists(st.integers(0, len(text)), max_size=8).map(
        lambda cuts: [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)], strict=True)]
    )


@settings(max_examples=300, deadline=None)
@given(data=st.data(), text=st.text("ab c\n文", max_size=30), stop=st.text("ab c\n文", min_size=1, max_size=4))
def test_random_splits_match_find_reference(data, text, stop):
    pieces = data.draw(_splits(text))
    emitted, stopped, _ = _run([stop], pieces)
    cut = text.find(stop)
    assert emitted == (text[:cut] if cut >= 0 else text)
    assert stopped == (cut >= 0)


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    text=st.text("abc", max_size=30),
    stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=4),
    include_stop=st.booleans(),
)
def test_random_splits_several_stops_match_scan_reference(data, text, stops, include_stop):
    pieces = data.draw(_splits(text))
    emitted, stopped, _ = _run(stops, pieces, include_stop=include_stop)
    assert (emitted, stopped) == _reference(text, stops, include_stop)
