"""Incremental detokenization: the streamed pieces add up to the full decode, stop strings cut the text and are
never streamed."""

from __future__ import annotations

import random

from engine.detokenizer import IncrementalDetokenizer


def test_pieces_add_up_to_full_decode(tokenizer) -> None:
    texts = ["Hello, world! Ça va? 日本語のテキスト 🙂🙃 done.", "def f(x):\n    return x ** 2\n", "  spaced   out  "]
    rng = random.Random(0)
    sequences = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    sequences += [[rng.randrange(tokenizer.vocab_size) for _ in range(40)] for _ in range(5)]
    for ids in sequences:
        detok = IncrementalDetokenizer(tokenizer)
        streamed = ""
        for token in ids:
            detok.add(token)
            streamed += detok.pop_new_text(finished=False)
        streamed += detok.pop_new_text(finished=True)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert detok.text == full
        # A trailing incomplete character may be held back until more bytes arrive; everything else streams.
        assert streamed == full.rstrip("\ufffd") or streamed == full


def test_stop_string_is_cut_and_never_streamed(tokenizer) -> None:
    ids = tokenizer("The answer is 42. END of story", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, stop=(" END",))
    streamed = ""
    for token in ids:
        detok.add(token)
        if detok.truncate_at_stop():
            streamed += detok.pop_new_text(finished=True)
            break
        streamed += detok.pop_new_text(finished=False)
    assert detok.text == "The answer is 42."
    assert streamed == "The answer is 42."
