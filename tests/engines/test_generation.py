"""The transformers generation engine on the synthetic tiny-llama, on CPU.

One engine is loaded for the module (the continuous batching manager and its threads);
the tests that kill or close an engine load their own small one.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tidegate.engines.base import GenerationEngine, Resume, SamplingParams, TokenEvent
from tidegate.engines.generation import (
    IncrementalDetokenizer,
    TransformersGenerator,
    cache_sizing,
)
from tidegate.engines.steps import StepTotals, join_cost_ms, table_between
from tidegate.engines.tiny_llama import MARKER, ensure_tiny_llama, tiny_llama_dir
from tidegate.errors import InvalidRequest, PromptTooLong, ReplicaFailed

GREEDY = 0.0


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        root = tmp_path_factory.mktemp("cache")
        ensure_tiny_llama(root)
        yield root


@pytest.fixture(scope="module")
def engine(cache: Path) -> Iterator[TransformersGenerator]:
    engine = TransformersGenerator(
        "tiny-llama", synthetic=True, max_num_seqs=8, seed=0, cache_dir=cache
    )
    # The worker loads off its event loop, in a thread: so does this.
    loader = threading.Thread(target=engine.load)
    loader.start()
    loader.join(timeout=120)
    assert engine.card.max_context_tokens > 0
    yield engine
    engine.close()


async def run(
    engine: GenerationEngine, seq_id: str, prompt: str, params: SamplingParams
) -> list[TokenEvent]:
    return [event async for event in engine.generate(seq_id, engine.encode(prompt), params)]


async def drain(stream: AsyncIterator[TokenEvent]) -> None:
    async for _ in stream:
        pass


def text_of(events: list[TokenEvent]) -> str:
    return "".join(event.text for event in events)


class Told:
    """An engine owner's failure callback: the reasons it heard, and an event to wait on."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.event = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.event.set()


def non_daemon_threads() -> set[threading.Thread]:
    """Threads that would keep the interpreter alive, less the event loop's own executor."""
    main = threading.main_thread()
    return {
        t
        for t in threading.enumerate()
        if not t.daemon and t is not main and not t.name.startswith("asyncio_")
    }


# --------------------------------------------------------------------------- the model folder
def test_build_writes_the_same_bytes_every_time(cache: Path, tmp_path: Path) -> None:
    first = tiny_llama_dir(cache)
    second = ensure_tiny_llama(tmp_path)
    names = sorted(p.name for p in first.iterdir())
    assert {"model.safetensors", "tokenizer.json", "config.json", MARKER} <= set(names)
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert "RANDOM WEIGHTS" in (first / MARKER).read_text()


def test_a_built_folder_is_reused_and_racing_builds_end_with_one_folder(tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_tiny_llama(tmp_path)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2
    assert results[0] == results[1] == tiny_llama_dir(tmp_path)
    stamp = (results[0] / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_llama(tmp_path) == results[0]
    assert (results[0] / "model.safetensors").stat().st_mtime_ns == stamp
    # No scratch folder is left behind by the build that lost the race.
    assert [p.name for p in (tmp_path / "models").iterdir()] == [results[0].name]


def test_the_cache_folder_defaults_to_tidegate_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TIDEGATE_CACHE", str(tmp_path))
    assert tiny_llama_dir() == tmp_path / "models" / "tiny-llama-v1"


def test_it_loads_like_any_local_folder(cache: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_llama_dir(cache)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    text = "héllo, tidegate 🌊"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # lossless bytes
    assert model.config.max_position_embeddings >= 1024
    assert tokenizer.eos_token_id == model.config.eos_token_id == 2


@pytest.mark.asyncio
async def test_a_local_folder_serves_greedy_text_as_transformers_generate(cache: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = tiny_llama_dir(cache)
    engine = TransformersGenerator("local", model_path=str(folder), max_num_seqs=2)
    await asyncio.to_thread(engine.load)
    try:
        assert not engine.card.synthetic
        assert str(folder) in engine.card.description
        prompt = engine.encode("hello tidegate")
        params = SamplingParams(max_tokens=24, temperature=GREEDY)
        events = [event async for event in engine.generate("g", prompt, params)]
    finally:
        await asyncio.to_thread(engine.close)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    assert text_of(events) == engine.decode(out[0, len(prompt) :].tolist())


# --------------------------------------------------------------------------- card and prompts
def test_card_bounds_requests_by_the_kv_cache(engine: TransformersGenerator) -> None:
    card = engine.card
    assert isinstance(engine, GenerationEngine)
    assert (card.task, card.engine, card.synthetic) == ("generate", "transformers", True)
    assert "SYNTHETIC" in card.description
    assert 0 < card.max_output_tokens < card.max_context_tokens
    assert engine.sizing is not None
    # One request can never outgrow the cache (that would kill the manager); the card
    # tells the worker the cache's size, so that it starts only sequences that fit.
    assert engine.sizing.capacity_tokens >= card.max_context_tokens
    assert engine.sizing.capacity_tokens >= engine.max_num_seqs * min(512, card.max_context_tokens)
    assert (card.max_cached_tokens, card.cache_page_tokens) == (
        engine.sizing.capacity_tokens,
        engine.sizing.page_size,
    )
    assert not card.per_request_seed  # one generator for the whole batch
    memory = engine.memory()
    assert memory.device == "cpu"
    assert 100_000 < memory.weights_bytes < 10_000_000
    assert memory.peak_bytes > memory.weights_bytes


def test_cache_sizing_rounds_up_to_whole_pages() -> None:
    sizing = cache_sizing(max_num_seqs=3, context_tokens=100, page_size=32)
    assert sizing.num_blocks == 3 * 4
    assert sizing.capacity_tokens >= 300


@pytest.mark.parametrize(
    ("max_num_seqs", "context_tokens", "num_blocks"),
    [
        (16, 8192, 256),  # smollm2: 16 typical sequences of 512 tokens = one full context
        (32, 8192, 512),  # more sequences: more typical ones
        (2, 8192, 256),  # few sequences: still one full context
        (16, 1024, 256),  # tiny-llama
    ],
)
def test_cache_sizing_holds_one_full_context_and_typical_sequences(
    max_num_seqs: int, context_tokens: int, num_blocks: int
) -> None:
    sizing = cache_sizing(max_num_seqs, context_tokens, page_size=32, typical_seq_tokens=512)
    assert sizing.num_blocks == num_blocks


def test_chat_prompts_use_the_template_or_a_plain_join(
    engine: TransformersGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    templated = engine.decode(engine.encode_chat(messages))
    assert templated == "user\nhi" + "assistant\n"  # specials <s> and </s> are not shown
    monkeypatch.setattr(engine._tokenizer, "chat_template", None)
    assert engine.decode(engine.encode_chat(messages)) == "user: hi\nassistant:"


def test_detokenizer_holds_back_incomplete_characters(engine: TransformersGenerator) -> None:
    text = "plain, accents é ü, wide 世界 and an emoji 🌊!"
    ids = engine.encode(text)
    detokenizer = IncrementalDetokenizer(engine.decode, engine.encode("prompt: "))
    deltas = [detokenizer.update(ids[: n + 1]) for n in range(len(ids))]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == text
    # A sequence ending mid-character still shows what it made.
    cut = IncrementalDetokenizer(engine.decode, [])
    partial = engine.encode("🌊")[:2]
    assert cut.update(partial) == ""
    assert cut.update(partial, final=True) == "\ufffd"


# --------------------------------------------------------------------------- generation
@pytest.mark.asyncio
async def test_concurrent_sequences_each_get_their_own_length(
    engine: TransformersGenerator,
) -> None:
    lengths = [1, 5, 17, 33, 40]
    greedy = [SamplingParams(max_tokens=n, temperature=GREEDY) for n in lengths]
    results = await asyncio.gather(
        *(run(engine, f"len-{i}", "hello tidegate", p) for i, p in enumerate(greedy))
    )
    # Greedy from this prompt makes no end-of-sequence within 40 tokens.
    for n, events in zip(lengths, results, strict=True):
        assert events[-1].num_tokens == n
        assert events[-1].finish_reason == "length"
        assert all(e.finish_reason is None for e in events[:-1])
        counts = [e.num_tokens for e in events]
        assert counts == sorted(set(counts))  # strictly increasing
    # Same prompt, greedy: the shorter outputs are prefixes of the longer ones.
    texts = [text_of(events) for events in results]
    for shorter, longer in itertools.pairwise(texts):
        assert longer.startswith(shorter)
    assert engine.num_running == 0


@pytest.mark.asyncio
async def test_the_engine_times_its_steps_by_kind_and_sequences_running(
    engine: TransformersGenerator,
) -> None:
    """A chat that starts alone, then a second that joins while the first decodes: the
    engine's step table has the start, the join and the decode steps in between."""
    before = engine.steps.table()
    greedy = SamplingParams(max_tokens=200, temperature=GREEDY)
    first = engine.generate("steps-a", engine.encode("hello tidegate"), greedy)
    first_event = await anext(first)  # it decodes from here until closed
    joined = await run(engine, "steps-b", "a second prompt", SamplingParams(4, GREEDY))
    await first.aclose()
    window = table_between(before, engine.steps.table())
    assert first_event.num_tokens >= 1
    assert joined[-1].num_tokens == 4
    start = window[("start", 1)]  # the first chat, alone on an idle engine
    assert (start.num_steps, start.num_joins) == (1, 1)
    join = window[("join", 2)]  # the second, joining the first as it decodes
    assert join.num_joins == 1
    assert join.seconds > 0
    decode = window[("decode", 2)]  # both decoding: the second's other 3 tokens at least
    assert decode.num_steps >= 3
    assert decode.num_joins == 0
    cost = join_cost_ms(window)
    assert cost is not None
    assert cost.num_joins == 1
    assert cost.decode_ms == pytest.approx(1e3 * decode.seconds / decode.num_steps)


def test_a_join_is_priced_against_decode_steps_of_as_many_sequences() -> None:
    window = {
        ("decode", 4): StepTotals(10, 1.0, 0),  # 100 ms a step
        ("decode", 8): StepTotals(4, 0.8, 0),  # 200 ms a step
        ("join", 4): StepTotals(2, 0.5, 2),  # 250 ms each: 150 ms a joiner
        ("join", 8): StepTotals(1, 0.5, 3),  # 500 ms: 300 over three joiners
        ("join", 6): StepTotals(5, 9.0, 5),  # no decode step of 6 ran: left out
        ("start", 4): StepTotals(1, 2.0, 4),  # an idle engine's prompts: not a join
    }
    cost = join_cost_ms(window)
    assert cost is not None
    assert cost.num_joins == 5
    assert cost.join_ms == pytest.approx((2 * 150 + 300) / 5)
    assert cost.decode_ms == pytest.approx((2 * 100 + 200) / 3)
    assert join_cost_ms({("decode", 4): StepTotals(3, 0.3, 0)}) is None


def test_a_window_counts_cells_new_since_its_start() -> None:
    first = {("decode", 2): StepTotals(5, 0.5, 0)}
    last = {("decode", 2): StepTotals(7, 0.9, 0), ("join", 2): StepTotals(1, 0.2, 1)}
    assert table_between(first, last) == {
        ("decode", 2): StepTotals(2, pytest.approx(0.4), 0),
        ("join", 2): StepTotals(1, 0.2, 1),
    }
    assert table_between(last, last) == {}


@pytest.mark.asyncio
async def test_sampled_sequences_end_by_length_or_end_of_sequence(
    engine: TransformersGenerator,
) -> None:
    params = [SamplingParams(max_tokens=24 + 8 * i, temperature=1.0, top_p=0.95) for i in range(8)]
    results = await asyncio.gather(
        *(run(engine, f"sample-{i}", f"prompt number {i}", p) for i, p in enumerate(params))
    )
    for p, events in zip(params, results, strict=True):
        last = events[-1]
        assert last.finish_reason in {"stop", "length"}
        if last.finish_reason == "length":
            assert last.num_tokens == p.max_tokens
        else:  # the random model drew its end-of-sequence token
            assert 1 <= last.num_tokens <= p.max_tokens


@pytest.mark.asyncio
async def test_greedy_is_deterministic(engine: TransformersGenerator) -> None:
    params = SamplingParams(max_tokens=32, temperature=GREEDY)
    first = text_of(await run(engine, "greedy-a", "The tide gate", params))
    second = text_of(await run(engine, "greedy-b", "The tide gate", params))
    assert first
    assert first == second


@pytest.mark.asyncio
async def test_a_stop_string_truncates_the_output(engine: TransformersGenerator) -> None:
    full = text_of(await run(engine, "full", "stop here", SamplingParams(32, GREEDY)))
    # A stop string from the middle of the greedy output: two visible characters.
    start = next(
        i
        for i in range(3, len(full) - 2)
        if full[i : i + 2].isprintable() and "\ufffd" not in full[i : i + 2]
    )
    stop = full[start : start + 2]
    events = await run(engine, "stopped", "stop here", SamplingParams(32, GREEDY, stop=(stop,)))
    assert events[-1].finish_reason == "stop"
    assert text_of(events) == full[: full.index(stop)]
    assert events[-1].num_tokens < 32
    assert engine.num_running == 0


@pytest.mark.asyncio
async def test_closing_a_stream_early_frees_it(engine: TransformersGenerator) -> None:
    stream = engine.generate("early", engine.encode("x"), SamplingParams(max_tokens=900))
    seen = 0
    async for event in stream:
        seen = event.num_tokens
        if seen >= 3:
            break
    assert engine.num_running == 1
    await stream.aclose()
    assert seen >= 3
    assert engine.num_running == 0
    # A consumer cancelled while it waits frees its sequence too.
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("cancelled", engine.encode("y"), SamplingParams(900)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.num_running == 0
    # The engine goes on serving, the same sequence id included.
    events = await run(engine, "early", "x", SamplingParams(max_tokens=4, temperature=GREEDY))
    assert events[-1].num_tokens == 4


@pytest.mark.asyncio
async def test_a_paused_sequence_resumes_where_its_client_stopped(
    engine: TransformersGenerator,
) -> None:
    """Preemption's pause and resume: stopped after a few tokens, then given them back as
    ``Resume``: its client's text is that of its tokens, once, and it makes the rest."""
    prompt = engine.encode("The tide gate opens")
    params = SamplingParams(max_tokens=24, temperature=GREEDY)
    stream = engine.generate("paused", prompt, params)
    before: list[TokenEvent] = []
    async for event in stream:
        before.append(event)
        if event.num_tokens >= 5:
            break
    await stream.aclose()
    assert engine.num_running == 0
    made = tuple(before[-1].token_ids)
    sent = text_of(before)
    after = [
        event async for event in engine.generate("paused", prompt, params, Resume(made, len(sent)))
    ]
    final = after[-1]
    assert final.finish_reason is not None
    assert tuple(final.token_ids[: len(made)]) == made
    assert final.num_tokens == len(final.token_ids) > len(made)
    whole = IncrementalDetokenizer(engine.decode, prompt).update(list(final.token_ids), final=True)
    assert sent + text_of(after) == whole


@pytest.mark.asyncio
async def test_a_request_over_the_context_is_refused(engine: TransformersGenerator) -> None:
    params = SamplingParams(max_tokens=engine.card.max_context_tokens)
    with pytest.raises(PromptTooLong):
        await run(engine, "too-long", "some prompt", params)
    assert engine.num_running == 0


@pytest.mark.asyncio
async def test_an_empty_prompt_is_refused_before_it_reaches_the_manager(
    engine: TransformersGenerator,
) -> None:
    assert engine.encode("") == []  # the byte tokenizer adds no special token
    # Alone in a step, a sequence of no tokens kills the manager's loop (issue 11).
    with pytest.raises(InvalidRequest, match="no tokens"):
        await run(engine, "empty", "", SamplingParams(max_tokens=1))
    assert engine.num_running == 0
    events = await run(engine, "after-empty", "x", SamplingParams(max_tokens=2, temperature=GREEDY))
    assert events[-1].num_tokens == 2


# --------------------------------------------------------------------------- failure and close
@pytest.mark.asyncio
async def test_a_dead_manager_fails_running_and_later_sequences(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = non_daemon_threads()  # the module's engine has its own
    engine = TransformersGenerator(
        "tiny-llama", max_num_seqs=1, max_context_tokens=64, cache_dir=cache
    )
    await asyncio.to_thread(engine.load)
    told = Told()
    engine.on_failure(told)
    try:
        stream = engine.generate("victim", engine.encode("a"), SamplingParams(max_tokens=60))
        await anext(stream)

        def crash(*args: object, **kwargs: object) -> None:
            raise RuntimeError("simulated device failure")

        # The next forward pass fails: fatal for the manager's generation loop.
        monkeypatch.setattr(engine._model, "forward", crash)
        # The sequence fails plainly; the reason goes to the log and the owner, not the client.
        with pytest.raises(ReplicaFailed, match="failed") as cut:
            await asyncio.wait_for(drain(stream), 60)
        assert "simulated device failure" not in str(cut.value)
        with pytest.raises(ReplicaFailed):
            await run(engine, "after", "b", SamplingParams(max_tokens=2))
        assert engine.num_running == 0
        # Its owner is told once, from the reader thread, with the reason.
        assert await asyncio.to_thread(told.event.wait, 60)
        (reason,) = told.reasons
        assert "simulated device failure" in reason
    finally:
        await asyncio.to_thread(engine.close)
    assert told.reasons == [reason]  # closing a dead engine is not a second failure
    assert non_daemon_threads() <= before


@pytest.mark.asyncio
async def test_an_idle_engine_whose_loop_dies_tells_its_owner(cache: Path) -> None:
    engine = TransformersGenerator(
        "tiny-llama", max_num_seqs=1, max_context_tokens=64, cache_dir=cache
    )
    await asyncio.to_thread(engine.load)
    told = Told()
    engine.on_failure(told)
    try:
        # Issue 11's fault, past the engine's guard: a sequence of no tokens, alone in its
        # step, kills the manager's loop while no request of ours is running.
        engine._manager.add_request([], request_id="empty", max_new_tokens=1)
        assert await asyncio.to_thread(told.event.wait, 30), "the owner was never told"
        (reason,) = told.reasons
        assert "generation loop died" in reason
        late: list[str] = []
        engine.on_failure(late.append)  # an owner that comes after the death hears at once
        assert late == [reason]
        with pytest.raises(ReplicaFailed, match="generation loop died"):
            await run(engine, "after", "b", SamplingParams(max_tokens=2))
    finally:
        await asyncio.to_thread(engine.close)
    assert len(told.reasons) == 1


@pytest.mark.asyncio
async def test_close_fails_live_sequences_and_leaves_no_thread(cache: Path) -> None:
    before = non_daemon_threads()  # the module's engine has its own
    engine = TransformersGenerator("tiny-llama", max_num_seqs=2, cache_dir=cache)
    await asyncio.to_thread(engine.load)
    assert non_daemon_threads() - before  # this manager's generation thread
    stream = engine.generate("live", engine.encode("a"), SamplingParams(max_tokens=900))
    await anext(stream)
    await asyncio.to_thread(engine.close)
    with pytest.raises(ReplicaFailed, match="closed"):
        await asyncio.wait_for(drain(stream), 60)
    assert non_daemon_threads() <= before
    engine.close()  # idempotent
    with pytest.raises(ReplicaFailed):
        await run(engine, "after", "b", SamplingParams(max_tokens=2))
