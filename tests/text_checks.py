"""Output text against output tokens, step by step (shared by the engine and speculation tests)."""

from __future__ import annotations

from tandem import LLM, SamplingParams


def check_text_against_tokens(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple:
    """Step through one request: every step's text is a prefix of the final text (what a stream
    shows is never taken back), and the final text is the decode of its tokens, cut at the
    reported stop string. Returns (final text, stop reason, tokens)."""
    engine = llm.engine
    engine.add_request("r", prompt, params)
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
    final = out.outputs[0]
    assert all(final.text.startswith(t) for t in texts), texts
    full = llm.tokenizer.decode(final.token_ids, skip_special_tokens=True)
    stop = final.stop_reason
    if isinstance(stop, str):
        cut = full.index(
            stop, len(final.text) - len(stop) if params.include_stop_str_in_output else 0
        )
        assert final.text == full[: cut + len(stop) if params.include_stop_str_in_output else cut]
    else:
        assert final.text == full
    return final.text, stop, final.token_ids
