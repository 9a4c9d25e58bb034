"""Public API: text, stop conditions and stats of stream_generate / generate."""

import mlx.core as mx
from mlx_lm.generate import generate_step
from oracle import OracleDrafter

from dflash_mlx import generate, stream_generate


def test_stream_text_is_the_detokenized_tokens_and_matches_generate(pairs):
    model, tok = pairs("qwen3", "d2")
    rs = list(stream_generate(model, tok, "def parse_args(", max_tokens=40, raw=True))
    toks = [t for r in rs for t in r.tokens]
    text = "".join(r.text for r in rs)
    detok = tok.detokenizer  # mlx-lm's streaming detokenizer (it trims a leading space)
    detok.reset()
    for t in toks:
        detok.add_token(t)
    detok.finalize()
    assert text == detok.text and text.strip() == tok.decode(toks).strip()
    assert rs[-1].finish_reason in ("stop", "length")
    assert all(r.finish_reason is None for r in rs[:-1])
    assert text == generate(model, tok, "def parse_args(", max_tokens=40, raw=True)
    last = rs[-1]
    assert last.prompt_tokens == len(tok.encode("def parse_args("))
    assert last.generation_tokens == len(toks) and last.cycles > 0 and last.tau >= 1.0
    assert last.peak_memory > 0 and last.generation_tps > 0


def test_chat_template_is_applied_to_str_and_skipped_with_raw(pairs):
    model, tok = pairs("qwen3", "d2")
    r = next(stream_generate(model, tok, "hi", max_tokens=1))
    assert r.prompt_tokens == len(
        tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    )
    r = next(stream_generate(model, tok, "hi", max_tokens=1, raw=True))
    assert r.prompt_tokens == len(tok.encode("hi"))


def test_eos_stops_without_emitting_it(pairs):
    model, tok = pairs("qwen3_5", "d2")
    ids = tok.encode("def parse_args(")
    ref = [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=120)]
    eos = tok.eos_token_ids
    cut = next(i for i, t in enumerate(ref) if t in eos)
    rs = list(stream_generate(model, tok, ids, max_tokens=120))
    toks = [t for r in rs for t in r.tokens]
    assert toks == ref[:cut] and rs[-1].finish_reason == "stop"


def test_stop_string_truncates_text_even_inside_an_accepted_block(pairs):
    model, tok = pairs("qwen3", "d2")
    ids = tok.encode("import os\nfor i in")
    ref = [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=60)]
    detok = tok.detokenizer
    detok.reset()
    for t in ref:
        detok.add_token(t)
    detok.finalize()
    full = detok.text
    stop = full[20:24]
    real = model.drafter
    model.drafter = OracleDrafter(real, ids + ref + [0] * 20)  # full blocks accepted
    try:
        rs = list(stream_generate(model, tok, ids, max_tokens=60, stop=[stop, "zzzz"]))
    finally:
        model.drafter = real
    text = "".join(r.text for r in rs)
    assert text == full[: full.index(stop)] and rs[-1].finish_reason == "stop"


def test_max_tokens_gives_length(pairs):
    model, tok = pairs("qwen3", "d2")
    rs = list(stream_generate(model, tok, [5, 6, 7], max_tokens=7))
    assert sum(len(r.tokens) for r in rs) <= 7 and rs[-1].finish_reason in ("length", "stop")


def test_prompt_cache_prefills_only_the_new_turn(pairs):
    for kind in ("qwen3", "qwen3_5"):
        model, tok = pairs(kind, "d2")
        cache = model.make_cache()
        msgs = [{"role": "user", "content": "def parse_args("}]
        rs = list(stream_generate(model, tok, msgs, max_tokens=12, prompt_cache=cache))
        reply = "".join(r.text for r in rs)
        first = rs[-1].prompt_tokens
        assert rs[0].prompt_processed == first
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "import os"}]
        rs2 = list(stream_generate(model, tok, msgs, max_tokens=12, prompt_cache=cache))
        assert rs2[-1].prompt_processed < rs2[-1].prompt_tokens - first // 2
        # and the output equals a cold run on the same history
        cold = list(stream_generate(model, tok, msgs, max_tokens=12))
        assert [t for r in rs2 for t in r.tokens] == [t for r in cold for t in r.tokens]


def test_seeded_sampling_is_reproducible(pairs):
    model, tok = pairs("qwen3", "d2")
    a = generate(model, tok, "hello", max_tokens=20, temperature=0.9, seed=3)
    b = generate(model, tok, "hello", max_tokens=20, temperature=0.9, seed=3)
    assert a == b


def test_a_cycle_interrupted_mid_verify_leaves_a_usable_cache(pairs, monkeypatch):
    """Ctrl-C inside a cycle: the next call must still equal a cold run."""
    model, tok = pairs("qwen3", "d2")
    cache = model.make_cache()
    calls = {"n": 0}
    real_call = type(model.adapter).__call__

    def flaky(self, ids, c, **kw):
        calls["n"] += 1
        out = real_call(self, ids, c, **kw)
        if calls["n"] == 3:  # the verify already wrote into the caches
            mx.eval(out)
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(type(model.adapter), "__call__", flaky)
    try:
        list(stream_generate(model, tok, "def parse_args(", max_tokens=30, prompt_cache=cache))
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(type(model.adapter), "__call__", real_call)
    warm = generate(model, tok, "def parse_args(", max_tokens=20, prompt_cache=cache)
    assert warm == generate(model, tok, "def parse_args(", max_tokens=20)


def test_stats_count_the_cycles_that_verified_copied_drafts(pairs, monkeypatch):
    """``copied`` counts the cycles whose drafts came from the context, as the decode
    loop's own cycles report them; the CLI's stats and the server's extra field show it."""
    from references import PROMPTS

    from dflash_mlx import generation
    from dflash_mlx.cli.stats import stats_dict, stats_lines
    from dflash_mlx.server.schema import dflash_stats

    model, tok = pairs("qwen3", "d2")
    seen = []
    real = generation.decode

    def counting(*a, **k):
        for c in real(*a, **k):
            seen.append(c.lookup > 0)
            yield c

    monkeypatch.setattr(generation, "decode", counting)
    total = 0
    for prompt in PROMPTS:
        seen.clear()
        last = list(stream_generate(model, tok, prompt, max_tokens=48, block_size=4, raw=True))[-1]
        assert last.copied == sum(seen) and last.copied <= last.cycles
        total += last.copied
        s = stats_dict(last, "m", 4, True)
        assert s["copied_cycles"] == last.copied
        assert dflash_stats(last, 0, 4)["copied_cycles"] == last.copied
        shown = "\n".join(stats_lines(s))
        assert (f"{last.copied} copied" in shown) == (last.copied > 0)
    assert total > 0  # the random target loops: copies happened
    off = list(stream_generate(model, tok, PROMPTS[0], max_tokens=48, block_size=4, lookup=False))
    assert off[-1].copied == 0


def test_stats_count_the_cycles_that_took_a_sibling(pairs):
    """``siblings`` counts greedy tree cycles that committed a sibling of the first draft;
    the CLI's stats and the server's extra field show it, and ``tree=False`` has none."""
    from dflash_mlx.cli.stats import stats_dict, stats_lines
    from dflash_mlx.server.schema import dflash_stats

    model, tok = pairs("qwen3", "d2")
    ids = tok.encode("def parse_args(")
    ref = [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=64)]
    real = model.drafter
    model.drafter = OracleDrafter(real, ids + ref + [0] * 20, second_at=(1,))
    try:
        kw = {"max_tokens": 32, "block_size": 8, "lookup": False}
        on = list(stream_generate(model, tok, ids, **kw))
        off = list(stream_generate(model, tok, ids, tree=False, **kw))
    finally:
        model.drafter = real
    for rs in (on, off):
        assert [t for r in rs for t in r.tokens] == ref[:32]
    last, off = on[-1], off[-1]
    assert last.siblings >= last.cycles - 1 > 5 and off.siblings == 0
    s = stats_dict(last, "m", 8, True)
    assert s["sibling_cycles"] == dflash_stats(last, 0, 8)["sibling_cycles"] == last.siblings
    assert f"{last.siblings} took a sibling" in "\n".join(stats_lines(s))
    assert last.acceptance[0] > 0.9  # the first position is accepted, through the sibling


def _cycles():
    from dflash_mlx.decoding.steps import Cycle

    return [
        Cycle([1, 2, 3], accepted=2, drafted=3),  # reached 3 positions, accepted 2
        Cycle([5]),  # a plain step
        Cycle([7, 8], accepted=1, drafted=3, lookup=2),  # copied drafts, rejected at 2
        Cycle([9, 10], accepted=1, drafted=3, siblings=1, sibling=1),  # a sibling taken
    ]


def test_cycle_stats_are_computed_once_from_the_cycles():
    """tau, acceptance by position, blocks, plain/copied shares: the numbers every reader
    (responses, batches, the bench) takes from ``decoding.stats``."""
    from dflash_mlx.decoding.stats import CycleStats, RequestStats

    st = CycleStats(4)
    for c in _cycles():
        st.add(c)
    assert (st.cycles, st.committed, st.tau) == (4, 8, 2.0)
    assert st.reached == [3, 2, 1] and st.accepted == [3, 1, 0]
    assert st.acceptance == [1.0, 0.5, 0.0]
    assert st.histogram() == {1: 1, 4: 3} and st.plain_share == 0.25
    assert (st.copied, st.copied_share, st.siblings) == (1, 0.25, 1)
    a, b = CycleStats(4), CycleStats(4)
    for i, c in enumerate(_cycles()):
        (a if i % 2 else b).add(c)
    whole = a.merge(b)
    assert (whole.reached, whole.accepted, whole.histogram()) == ([3, 2, 1], [3, 1, 0], st.blocks)
    assert CycleStats(4).tau == 0.0 and CycleStats(4).acceptance == [0.0] * 3
    from dflash_mlx.decoding.steps import Cycle

    req = RequestStats(10, 4)
    req.add(Cycle([4], prompt_tokens=6, timings={"prefill": 0.5}))  # the prefill: not a cycle
    for c in _cycles():
        req.add(c)
    assert req.processed == 6 and req.cycles.cycles == 4 and req.timings == {"prefill": 0.5}


def test_stats_say_no_cycle_ran_when_the_prefill_gave_the_only_token(pairs):
    """``dflash run -m 1`` printed "tau 0.00 ... over 0 cycles" (and chat's /stats the same):
    the one token came from the prefill, no cycle ran. Plain steps only: no draft verified."""
    from dataclasses import replace

    from dflash_mlx.cli.stats import answer_stats, stats_dict, stats_lines

    def lines(r, block="auto"):
        return "\n".join(stats_lines(stats_dict(r, "m", block, True))) + "\n"

    model, tok = pairs("qwen3", "d2")
    last = list(stream_generate(model, tok, "def parse_args(", max_tokens=1, raw=True))[-1]
    assert last.cycles == 0 and last.generation_tokens == 1
    for shown in (lines(last), lines(last, 4), answer_stats(last)):
        assert "no drafting cycle ran; the prefill gave the only token" in shown
        assert "0 cycles" not in shown and "tau 0.00" not in shown
        assert "by block position" not in shown and "tok/s, tau" not in shown
    assert "[/dim] 1 token\n" in lines(last)  # no rate for a token the prefill made
    ended = replace(last, generation_tokens=0, tokens=[], finish_reason="stop")
    assert "the prefill's token ended the answer" in answer_stats(ended)
    plain = replace(last, cycles=3, tau=1.0, blocks={1: 3}, generation_tokens=4)
    shown = lines(plain) + answer_stats(plain)
    assert "1.00 tokens/cycle over 3 cycles" in shown and "tau 1.00 over 3 cycles" in shown
    assert "acceptance[/dim] none: every cycle was a plain step" in shown
    assert "acceptance none: no draft verified" in shown and "% by block position" not in shown
