"""Incremental detokenization against the tokenizer's own decode: the text the output tokens add
after the prompt's (vLLM's convention), with a SentencePiece-style tokenizer whose decoder drops
the first token's leading space and whose byte-fallback tokens split characters."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedlab.engine.detokenizer import IncrementalDetokenizer, _prompt_tail, find_stop_string


@pytest.fixture(scope="module")
def sp_tokenizer():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                            trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"]))
    model = json.loads(tok.to_str())["model"]
    vocab = {**model["vocab"], **{f"<0x{b:02X}>": len(model["vocab"]) + b for b in range(256)}}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok.model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream(tokenizer, prompt_ids, output_ids):
    detok = IncrementalDetokenizer(tokenizer, True, prompt_ids)
    pieces = [detok.append(t) for t in output_ids]
    assert "".join(pieces) == detok.text
    return detok.text


@pytest.mark.parametrize("prompt,output", [
    ("the quick", " brown fox jumps"),
    ("<s>the lazy", " dog \u00e9 over"),  # a two-byte character over byte-fallback tokens
    ("\u00e9 the quick brown", " fox \u00fc"),  # the prompt's 4-token tail starts mid-character
    ("the quick brown fox", "</s>"),
])
def test_output_text_is_what_it_adds_to_the_prompt(sp_tokenizer, prompt, output):
    prompt_ids = sp_tokenizer.encode(prompt, add_special_tokens=False)
    output_ids = sp_tokenizer.encode(prompt + output, add_special_tokens=False)[len(prompt_ids):]
    assert sp_tokenizer.decode(prompt_ids + output_ids) == prompt + output  # the split is exact
    whole = sp_tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
    added = whole[len(sp_tokenizer.decode(prompt_ids, skip_special_tokens=True)):]
    assert stream(sp_tokenizer, prompt_ids, output_ids) == added
    if output.startswith(" "):
        assert added.startswith(" ") and not sp_tokenizer.decode(output_ids).startswith(" ")
    # without a prompt the stream decodes as the tokenizer does
    assert stream(sp_tokenizer, [], output_ids) == sp_tokenizer.decode(output_ids, skip_special_tokens=True)


def test_prompt_tail_starts_on_a_character(sp_tokenizer):
    ids = sp_tokenizer.encode("\u00e9 the quick brown", add_special_tokens=False)
    backend = sp_tokenizer.backend_tokenizer
    assert backend.decode(ids[-4:]).startswith("\ufffd")
    assert _prompt_tail(backend, ids, True) == ids[-5:]
    assert _prompt_tail(backend, ids[:2], True) == ids[:2]
    # from the euro sign's first byte
    whole = sp_tokenizer.encode("\u20ac the quick", add_special_tokens=False)[1:]
    assert sp_tokenizer.convert_ids_to_tokens(whole[:3]) == ["<0xE2>", "<0x82>", "<0xAC>"] and len(whole) == 5
    assert _prompt_tail(backend, whole, True) == whole  # only the whole prompt starts on a character


def test_engine_output_keeps_the_leading_space(sp_tokenizer, tmp_path):
    """Through the engine: greedy tokens held to "▁fox" and "▁dog" after "the quick brown" read
    " fox dog" (the text they add to the prompt's), not "fox dog" as they decode alone; the prompt
    text plus the output text is the tokenizer's decode of all the tokens."""
    torch = pytest.importorskip("torch")
    import transformers

    from pagedlab import LLM, SamplingParams

    sp_tokenizer.save_pretrained(tmp_path)
    cfg = transformers.LlamaConfig(vocab_size=len(sp_tokenizer), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path)
    allowed = sp_tokenizer.convert_tokens_to_ids(["\u2581fox", "\u2581dog"])
    prompt = "the quick brown"
    params = SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=allowed)
    with LLM(str(tmp_path), kv_cache_memory_bytes=8 << 20) as llm:
        out = llm.generate(prompt, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.token_ids) == 4 and set(completion.token_ids) <= set(allowed)
    want = "".join({allowed[0]: " fox", allowed[1]: " dog"}[t] for t in completion.token_ids)
    assert completion.text == want
    assert out.prompt + completion.text == sp_tokenizer.decode(out.prompt_token_ids + completion.token_ids,
                                                               skip_special_tokens=True)


def test_stop_string_completed_by_the_new_text():
    """A stop string counts when the new characters complete it, wherever it starts (earlier text
    included), as in vLLM; one wholly in the earlier text is not found. Where new characters
    complete two, the one that starts first wins, so no stop string stays in the text (vLLM takes
    the first in the list: ["rld", "wor"] would cut at "rld" and keep "wor")."""
    text = "hello world"  # "rld" is new
    assert find_stop_string(text, 3, ["o wor"]) == ("o wor", 4)
    assert find_stop_string(text, 3, ["rld", "wor"]) == ("wor", 6)
    assert find_stop_string(text, 3, ["hell", "o wo"]) is None  # "o wo" ends just before the new text
    assert find_stop_string(text, len(text), ["hell"]) == ("hell", 0)


def test_token_that_rewrites_returned_text_restarts_the_stream(sp_tokenizer):
    """An ASCII byte token then a stray continuation byte: the tokenizer's decode turns the text
    already returned ("l") into U+FFFD, which tokenizers' DecodeStream refuses with an error. As in
    vLLM, the stream starts afresh at that token rather than failing the request (and with it the
    engine step), in the output and in the prompt's tail alike."""
    ids = sp_tokenizer.convert_tokens_to_ids(["<0x6C>", "<0x9C>", "\u2581the", "\u2581fox"])
    assert sp_tokenizer.decode(ids) == "\ufffd\ufffd the fox"
    assert stream(sp_tokenizer, [], ids) == "lthe fox"
    assert stream(sp_tokenizer, ids, sp_tokenizer.convert_tokens_to_ids(["\u2581dog"])) == " dog"
