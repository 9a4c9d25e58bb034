"""The training-prompt pool (its growth at the end, the rounds' slices, replayed two-turn
chats) and the shard claims several distillation processes share."""

import json
import os
import time

import numpy as np

from dflash_mlx.bench.prompts import CHAT, CODE
from dflash_mlx.train import distill, prompts, rounds
from dflash_mlx.train.instructions import (
    chat_requests,
    code_instructions,
    extra_prompts,
    follow_ups,
)

EOS = 2
VOCAB = {0: "<|im_start|>", 1: "<|im_end|>", 2: "<|endoftext|>", 3: "user\n", 4: "assistant\n"}
VOCAB.update({5: "Why", 6: " is", 7: " it", 8: "?", 9: " Because", 10: "```"})


class FakeTokenizer:
    """ChatML-shaped decode over a tiny vocabulary; the template counts characters."""

    eos_token_ids = (EOS,)
    chat_template = "(counted)"  # it has one: distill.encode applies it

    def decode(self, ids):
        return "".join(VOCAB[i] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return list(range(sum(len(m["content"]) for m in messages)))


def test_the_pool_only_grows_at_its_end_and_rounds_never_share_a_prompt(monkeypatch):
    monkeypatch.setattr(prompts, "finished_rounds", list)
    base = prompts.build_prompts("train")
    pool = prompts.pool("train")
    assert pool[: len(base)] == base and len(pool) > len(base)
    extra = pool[len(base) :]
    assert not (set(CODE) | set(CHAT)) & set(extra)
    assert len(set(extra)) == len(extra) and not set(extra) & set(base)
    assert any("JavaScript" in p for p in extra) and any("haiku" in p for p in extra)
    slices = [rounds.round_prompts(r) for r in (1, 2)]
    assert [len(s) for s in slices] == list(rounds.ROUND_PROMPTS)
    assert not set(slices[0]) & set(slices[1])
    assert slices[0][0] == pool[rounds.ROUND0_PROMPTS]


def test_code_instructions_span_languages_sql_and_classes():
    code = code_instructions()
    for word in ("Python", "Rust", "Go", "SQL query", "class `Stack`", "difference between"):
        assert any(word in p for p in code), word
    assert extra_prompts([], set(code) | set(chat_requests([]))) == []  # exclusions dropped


def test_follow_ups_replay_finished_answers_and_skip_truncated_ones():
    prompt = [0, 3, 5, 6, 7, 8, 1, 0, 4]  # <|im_start|>user\nWhy is it?<|im_end|>...
    seqs = [
        (prompt, np.array([9, 7, EOS])),  # finished: replayed
        (prompt, np.array([9, 7, 7])),  # cut at the length limit: skipped
        (prompt, np.array([9] * 400 + [EOS])),  # too long to replay: skipped
    ]
    chats = follow_ups(FakeTokenizer(), seqs, {EOS})
    assert len(chats) == 2
    for chat in chats:
        assert [m["role"] for m in chat] == ["user", "assistant", "user"]
        assert chat[0]["content"] == "Why is it?" and chat[1]["content"] == "Because it"
    assert chats[0][2] != chats[1][2]


def test_a_replayed_chat_is_encoded_as_its_messages_with_a_longer_limit():
    tok = FakeTokenizer()
    chat = [{"role": "user", "content": "a" * 300}, {"role": "assistant", "content": "b" * 200}]
    assert len(distill.encode(tok, chat + [{"role": "user", "content": "more"}])) == 504
    assert distill.encode(tok, "a" * 504) is None  # a single text keeps the shorter limit
    assert distill.encode(tok, "short") == list(range(5))


def test_a_claim_kept_alive_by_heartbeats_is_never_taken_over(tmp_path):
    """A claim from another machine (whose pid cannot be checked here) lives by its age."""
    shard = tmp_path / "shard_0000"
    assert distill.claim(shard)
    tmp = shard.with_name("shard_0000.tmp")
    (tmp / "owner.json").write_text(json.dumps({"pid": 1, "host": "another-machine"}))
    old = time.time() - 4000
    os.utime(tmp, (old, old))
    distill.heartbeat(shard)  # the owner is still generating
    assert not distill.claim(shard, stale_s=1800)
    os.utime(tmp, (old, old))  # the owner died long ago
    assert distill.claim(shard, stale_s=1800)


def test_a_shard_finished_by_another_process_is_kept(tmp_path):
    shard = tmp_path / "shard_0000"
    seq = (np.arange(4, dtype=np.int32), np.arange(3), np.zeros((3, 2), np.float16))
    distill.claim(shard)
    distill.write_shard(shard, [seq], [2])
    first = np.load(shard / "tokens.npy")
    other = (seq[0] + 1, seq[1], seq[2])
    distill.write_shard(shard, [other], [2])  # a second writer of the same shard
    assert (np.load(shard / "tokens.npy") == first).all()
    assert not shard.with_name("shard_0000.tmp").exists()
