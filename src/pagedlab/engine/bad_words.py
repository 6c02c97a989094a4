"""``SamplingParams.bad_words`` as vLLM reads them: each word's token ids at admission, and at each
sampled row the ids the output so far bans."""

from __future__ import annotations


def bad_words_token_ids(tokenizer, bad_words: list[str], vocab_size: int) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word as it starts a text, and after a space where
    that gives a different first token and as many tokens (a word mid-sentence). An id out of
    the vocabulary is a ValueError naming the words."""
    sequences = []
    for word in bad_words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    bad = next((t for ids in sequences for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"bad_words={bad_words!r} is invalid: it tokenizes to id {bad}, out of "
                         f"vocabulary (ids must be in [0, {vocab_size}))")
    return sequences


def bad_word_bans(bad_words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """vLLM's rule: a bad word's last token is banned when the output ends with its other tokens
    (a one-token bad word always)."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(prefix) <= len(output_token_ids) and output_token_ids[-len(prefix):] == prefix):
            banned.append(word[-1])
    return banned
