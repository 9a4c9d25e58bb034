"""Following rank 0 and ending on a lost rank, in one process: the calls rank 0's engine
logs (``distributed.follow``) replayed by a follower decode the same tokens; a follower
whose prompt cache parted is named; the watchdog (``distributed.faults``) names a rank that
exits or hangs, passes on rank 0's word, and ignores a rank that said goodbye."""

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from dflash_mlx import DFlashError
from dflash_mlx.distributed import faults, follow, wire
from dflash_mlx.settings import GenerationConfig


class _Wire:
    """Rank 0's sends, kept in order; a follower's receives, in the same order."""

    rank, size = 0, 2

    def __init__(self, sent=None):
        self.sent = [] if sent is None else list(sent)

    def send(self, cmd):
        self.sent.append(json.loads(json.dumps(cmd)))  # what JSON keeps, as on the wire

    def recv(self):
        return self.sent.pop(0)


def _lead_serving(model, tok, wire):
    """Rank 0 as the engine drives it: two rows (one greedy, one sampled with no seed), one
    removed mid-answer, then the first prompt again (its prefix from the pool)."""
    from dflash_mlx.batching import BatchGenerator
    from dflash_mlx.server.prompt_cache import PromptPool

    lead = follow.Lead(wire)
    pool, gen = lead.pool(PromptPool(model, 10**9)), lead.batch(BatchGenerator(model, tok, 4))
    a, b = tok.encode("def parse_args(argv):"), tok.encode("import os")
    lent, out = {}, {}
    for ids, cfg in ((a, GenerationConfig(max_tokens=10, temperature=0.0)),
                     (b, GenerationConfig(max_tokens=10, temperature=1.0, block_size=4))):  # fmt: skip
        cache = pool.take(ids)
        lent[gen.insert(ids, cfg, cache=cache)] = cache
    for n in range(30):
        if n == 3:
            gen.remove(1)
            if 1 in lent:  # still in its prefill
                pool.give(lent.pop(1))
        if n == 6:
            cache = pool.take(a)
            lent[gen.insert(a, GenerationConfig(max_tokens=6, temperature=0.0), cache=cache)] = (
                cache
            )
        for uid, r in gen.step():
            out.setdefault(uid, []).extend(r.tokens)
            if uid in lent:
                pool.give(lent.pop(uid))
    lead.quit()
    return out


def _recorded(model, tok, seen: dict):
    """A follower's batch generator (4 rows) that keeps each request's tokens in ``seen``
    (a follower's replay discards them)."""
    from dflash_mlx.batching import BatchGenerator

    class Recorded(BatchGenerator):
        def step(self):
            got = super().step()
            for uid, r in got:
                seen.setdefault(uid, []).extend(r.tokens)
            return got

    return Recorded(model, tok, 4)


def test_a_follower_replaying_rank_zeros_calls_decodes_the_same_tokens(pairs):
    from dflash_mlx.server.prompt_cache import PromptPool

    model, tok = pairs("qwen3", "d2")
    wire = _Wire()
    lead_tokens = _lead_serving(model, tok, wire)
    assert sorted(lead_tokens) == [0, 1, 2] and len(lead_tokens[2]) == 6
    ops = [op[0] for msg in wire.sent for op in msg["ops"]]
    assert ops.count("take") == 3 and ops.count("remove") == 1 and ops[-1] == "quit"
    seeds = [op[2]["seed"] for msg in wire.sent for op in msg["ops"] if op[0] == "insert"]
    assert all(isinstance(s, int) for s in seeds)  # no rank reads its own clock for a seed

    seen = {}

    follow.follow_batches(wire, PromptPool(model, 10**9), lambda: _recorded(model, tok, seen))
    assert seen == lead_tokens and not wire.sent


def test_a_follower_whose_prompt_cache_parted_from_rank_zeros_is_named():
    wire = _Wire([{"ops": [["take", [1, 2, 3, 4], 0, 0], ["step"]]}])
    wire.rank = 1
    pool = SimpleNamespace(take=lambda ids: SimpleNamespace(tokens=ids[:3]))
    with pytest.raises(follow.Parted, match="rank 1's prompt cache reused 3 tokens where rank 0"):
        follow.follow_batches(wire, pool, lambda: None)


def test_followers_stop_at_the_cycle_where_rank_zero_broke_off():
    wire = _Wire()
    for r in follow.lead_stream(wire, iter(range(5))):
        if r == 2:
            break
    assert [m["op"] for m in wire.sent] == ["next", "next", "stop"]
    taken = []
    follow.follow_stream(wire, (taken.append(i) or i for i in range(5)))
    assert taken == [0, 1, 2] and not wire.sent
    list(follow.lead_stream(wire, iter(range(2))))  # read to its end: a "next" after each
    assert [m["op"] for m in wire.sent] == ["next", "next"]


def test_settings_cross_as_json_with_a_seed_pinned_and_auto_kept():
    cfg = GenerationConfig(logit_bias={5: -1.5}, stop=["\n\n"], temperature=0.7)
    sent = json.loads(json.dumps(wire.config_dict(cfg)))
    assert wire.config_of(sent) == cfg and cfg.block_size == "auto"  # rank 0 decides it
    assert wire.seeded(cfg, 2**40 + 3).seed == 3
    assert wire.seeded(GenerationConfig(seed=1), 5).seed == 1


SCHEMA = {"type": "object", "properties": {"n": {"enum": [1, 22]}}, "required": ["n"]}


def _agents(model, tok):
    """(ids, settings, processors) of three agents' rows: a JSON schema (greedy), a thinking
    budget of 3 before the schema (sampled, no seed: pinned), a free one with a stop."""
    from dflash_mlx.decoding.grammar import json_schema_grammar, make_processor
    from dflash_mlx.decoding.thinking import ThinkingGate

    vocab, grammar = model.adapter.vocab_size, json_schema_grammar(SCHEMA)
    opened, closed = tok.encode("(")[0], tok.encode(")")[0]  # any two ids mark the reasoning
    gate = ThinkingGate(opened, closed, True, make_processor(tok, vocab, grammar), budget=3)
    return [
        (tok.encode("def parse_args(argv):"), GenerationConfig(max_tokens=12, temperature=0.0),
         [make_processor(tok, vocab, grammar, eos=[3])]),
        # sampled: a fixed block (a batch's auto plans by its clock; across ranks rank 0's)
        (tok.encode("import os"), GenerationConfig(max_tokens=12, temperature=1.0,
                                                   block_size=4), [gate]),
        (tok.encode("class Foo:"), GenerationConfig(max_tokens=12, temperature=0.0,
                                                    stop=["The"]), []),
    ]  # fmt: skip


def test_a_follower_rebuilds_rank_zeros_grammars_and_thinking_gates_and_decodes_alike(pairs):
    from dflash_mlx.batching import BatchGenerator

    model, tok = pairs("qwen3", "d2")
    wire, lead_out, seen = _Wire(), {}, {}
    gen = follow.Lead(wire).batch(BatchGenerator(model, tok, 4))
    for ids, cfg, procs in _agents(model, tok):
        gen.insert(ids, cfg, processors=procs)
    while len(gen._gen):
        for uid, r in gen.step():
            lead_out.setdefault(uid, []).append(r)
    follow.Lead(wire).quit()
    texts = ["".join(r.text for r in lead_out[u]) for u in range(3)]
    assert json.loads(texts[0])["n"] in (1, 22) and ")" in texts[1]  # the budget closed it
    assert lead_out[2][-1].finish_reason == "stop" and "The" not in texts[2], texts

    follow.follow_batches(wire, None, lambda: _recorded(model, tok, seen))
    assert seen == {u: [t for r in rs for t in r.tokens] for u, rs in lead_out.items()}


def test_rank_zero_refuses_logits_processors_it_cannot_send(pairs):
    from dflash_mlx.batching import BatchGenerator

    model, tok = pairs("qwen3", "d2")
    gen = follow.Lead(_Wire()).batch(BatchGenerator(model, tok, 2))
    with pytest.raises(DFlashError, match="type function cannot run across several processes"):
        gen.insert([1, 2], GenerationConfig(), processors=[lambda toks, logits: logits])
    assert not gen._lead.ops[1:]  # nothing logged: the other ranks never see it


def test_rank_zero_refuses_images_it_cannot_send_in_one_line(pairs):
    from dflash_mlx.batching import BatchGenerator

    model, tok = pairs("qwen3", "d2")
    wire = _Wire()
    gen = follow.Lead(wire).batch(BatchGenerator(model, tok, 2))
    with pytest.raises(DFlashError, match="^images without their files' bytes do not reach"):
        gen.insert([1, 2], GenerationConfig(), images=object())
    assert not gen._lead.ops[1:]  # nothing logged: the followers never see it


def test_the_server_answers_every_job_503_when_the_group_breaks(pairs):
    from dflash_mlx.server.worker import Engine, Job

    model, tok = pairs("qwen3", "d2")
    engine = Engine(model, tok)
    job = Job([1, 2, 3], GenerationConfig())
    assert engine.submit(job)
    engine.abandon("rank 1 of 2 exited", settle=0)
    kind, err = job.out.get_nowait()
    assert kind == "error" and err.status == 503 and err.code == "server_group_broken"
    assert "rank 1 of 2 exited" in str(err) and job.out.get_nowait() == ("end", None)
    assert not engine.submit(Job([1], GenerationConfig()))


@pytest.fixture
def ended(monkeypatch):
    """What the watchdog would say and end with (nothing ends here)."""
    said, codes = [], []
    monkeypatch.setattr(faults, "_say", said.append)
    monkeypatch.setattr(faults.os, "_exit", codes.append)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    return said, codes


def _wait(cond, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def _rank_zero(size=2, on_fault=None):
    dog, port = faults.Watchdog(0, size, on_fault), []
    t = threading.Thread(target=dog.lead, args=(port.append,), daemon=True)
    t.start()
    assert _wait(lambda: port)
    return dog, port[0], t


@pytest.mark.parametrize("hangs", [False, True])
def test_rank_zero_names_a_rank_that_exits_or_hangs(ended, monkeypatch, hangs):
    said, codes = ended
    monkeypatch.setattr(faults, "HANG_S", 0.3)
    faulted = []
    dog, port, _ = _rank_zero(on_fault=faulted.append)
    peer = socket.create_connection(("127.0.0.1", port))
    peer.sendall(b"rank 1\n")
    if not hangs:
        peer.close()
    assert _wait(lambda: codes == [1]), said
    why = "stopped answering for 0.3 s" if hangs else "exited"
    assert said == [f"error: rank 1 of 2 {why}; every rank stops (rank 0 now)"]
    assert faulted == [f"rank 1 of 2 {why}"]  # the server's clients were answered first
    peer.close()
    dog.close()


def _group(size):
    dog, port, t = _rank_zero(size=size)
    followers = [faults.Watchdog(k, size) for k in range(1, size)]
    for f in followers:
        threading.Thread(target=f.follow, args=(port,), daemon=True).start()
    t.join(5)
    assert sorted(dog.peers) == list(range(1, size))
    return dog, followers


def test_every_rank_names_the_rank_that_rank_zero_lost(ended):
    said, codes = ended
    dog, (one, two) = _group(3)
    two.done.set()  # rank 2 goes: its connection closes with no goodbye
    two.peers[0].close()
    assert _wait(lambda: len(codes) == 2), said
    assert sorted(said) == [
        "\nerror: rank 2 of 3 exited; every rank stops (rank 0 now)",  # after an answer
        "error: rank 2 of 3 exited; every rank stops (rank 1 now)",  # rank 0's word
    ]
    one.close()
    dog.close()


def test_a_rank_that_said_goodbye_is_no_fault(ended):
    said, codes = ended
    dog, (one,) = _group(2)
    one.close()  # "bye", then its connection closes
    time.sleep(0.5)
    dog.close()
    assert codes == [] and said == []


def test_a_chat_follower_holds_rank_zeros_session_cache_turn_after_turn(pairs, monkeypatch):
    import io
    import signal

    from dflash_mlx.cli import chat_ranks
    from dflash_mlx.cli.chat import ChatSession

    model, tok = pairs("qwen3", "d2")
    made = []
    real = model.make_cache
    monkeypatch.setattr(model, "make_cache", lambda: made.append(real()) or made[-1])
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the follower leaves pytest's
    wire = _Wire()
    lines = "hello there\n/reset\nwhat now\nand then\n/exit\n"
    gen = GenerationConfig(max_tokens=6, block_size=8, temperature=1.0)  # no seed: pinned
    s = ChatSession(model, tok, "tiny", gen, stdin=io.StringIO(lines), stdout=io.StringIO())
    s.lead = chat_ranks.ChatLead(wire, dog=None)
    s.loop()
    s.lead.quit()
    assert [m["op"] for m in wire.sent if m["op"] in ("turn", "reset")] == [
        "turn", "reset", "turn", "turn"
    ]  # fmt: skip
    ours = list(s.cache.tokens)
    chat_ranks.follow_chat(wire, None, model, tok)
    assert not wire.sent and made[-1] is not s.cache
    assert list(made[-1].tokens) == ours and len(ours) > 12  # two turns and two answers


def test_rank_zero_ends_when_its_command_waits_too_long_on_live_ranks(ended, monkeypatch):
    said, codes = ended
    monkeypatch.setattr(faults, "BEAT_S", 0.05)
    dog = faults.Watchdog(0, 2)
    dog.channel = SimpleNamespace(sending_since=time.monotonic() - faults.STALL_S - 1)
    dog._start()  # no peers: only the beat, which watches the send
    assert _wait(lambda: codes == [1]), said
    assert "rank 0 waited 60 s for the other ranks to take its next command" in said[0]
    dog.close()
