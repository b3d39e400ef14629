"""What users hand the engine: NumPy and torch integers are integers (prompt tokens, stop ids,
max_new_tokens, sampling knobs), floats and bools are refused at construction naming the field,
and ids outside the vocabulary fail the request at ``submit`` with a message that says so."""

import numpy as np
import pytest
import torch

from engine import Engine, EngineConfig, Request, SamplingParams, SchedulerConfig, Status
from models.minimax_m3 import build_from_preset


def test_numpy_and_torch_integers_are_accepted_and_stored_as_ints():
    r = Request("a", np.array([1, 2, 3]), max_new_tokens=np.int64(3), stop_token_ids=[torch.tensor(2), np.int32(5)],
                sampling=SamplingParams(temperature=np.float32(0.5), top_k=np.int64(4), top_p=torch.tensor(0.9),
                                        seed=np.uint64(7)))
    assert r.prompt == (1, 2, 3) and all(type(t) is int for t in r.prompt)
    assert r.max_new_tokens == 3 and type(r.max_new_tokens) is int
    assert r.stop_token_ids == frozenset({2, 5})
    s = r.sampling
    assert (type(s.temperature), type(s.top_k), type(s.top_p), type(s.seed)) == (float, int, float, int)
    assert s.temperature == 0.5 and s.top_k == 4 and s.seed == 7
    assert Request("b", torch.tensor([4, 5]), 1).prompt == (4, 5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt=[1, 2.5]), r"request 'x': prompt\[1\] = 2.5 is not an integer token id"),
    (dict(prompt=[True]), r"prompt\[0\] = True is not an integer token id"),
    (dict(prompt="abc"), r"request 'x': prompt must be a sequence of integers, got str"),
    (dict(prompt=torch.tensor([1.0])), r"prompt must be a 1-D integer sequence, got a torch.float32 tensor"),
    (dict(stop_token_ids=[1.0]), r"stop_token_ids\[0\] = 1.0 is not an integer token id"),
    (dict(max_new_tokens=np.float32(3)), r"max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=0), r"max_new_tokens must be an int >= 1, got 0"),
])
def test_non_integers_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Request(**{"request_id": "x", "prompt": [1], "max_new_tokens": 2, **kwargs})


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=np.float32(-1)), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(top_k=np.float64(2)), "top_k must be an int >= 0"),
    (dict(top_p=np.float32(0)), r"top_p must be in \(0, 1\]"),
    (dict(seed=-1), r"seed must be None or an int in \[0, 2\*\*64\)"),
])
def test_sampling_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_ids_outside_the_vocabulary_fail_at_submit_naming_the_request():
    runner = build_from_preset("tiny", max_tokens=24, max_seqs=2, max_seq_len=64)
    engine = Engine(runner, EngineConfig(SchedulerConfig()))
    v = runner.vocab_size
    prompt = engine.submit(Request("p", np.array([1, v]), 2))
    stop = engine.submit(Request("s", [1, 2], 2, stop_token_ids=[v + 5]))
    ok = engine.submit(Request("ok", np.array([1, 2]), 2, stop_token_ids=[np.int64(v - 1)]))
    assert prompt.status is Status.FAILED and prompt.error == (
        f"request 'p': prompt token {v} is outside the vocabulary [0, {v})")
    assert stop.status is Status.FAILED and stop.error.startswith(
        f"request 's': stop token id {v + 5} is outside the vocabulary [0, {v}); the model can never generate it")
    engine.drain()
    assert ok.status is Status.FINISHED and len(ok.output) == 2
