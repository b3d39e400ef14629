"""What a newcomer meets first: the builders' defaults match the README, and refusals name the
request and the method to call."""

import inspect

import pytest
import torch

from models.minimax_m3 import build_from_checkpoint, build_from_preset
from steps import TokenChunk


@pytest.mark.parametrize("builder", [build_from_preset, build_from_checkpoint])
def test_builders_default_to_the_auto_backend(builder):
    assert inspect.signature(builder).parameters["backend"].default == "auto"
    assert inspect.signature(builder).parameters["producer"].default == "auto"


def test_auto_resolves_to_torch_on_cpu_and_says_why():
    runner = build_from_preset("tiny", max_tokens=16, max_seqs=2, max_seq_len=32)
    choice = runner.backend.auto_choice
    assert choice.kind == "torch" and set(choice.skipped) == {"flashinfer", "triton"}
    assert all("needs a CUDA cache" in why for why in choice.skipped.values())


@pytest.fixture()
def runner():
    return build_from_preset("tiny", max_tokens=24, max_seqs=2, max_seq_len=32, num_pages=4)


@pytest.mark.parametrize("call", ["free_request", "num_written", "rewind"])
def test_unknown_requests_name_the_method_to_call(runner, call):
    with pytest.raises(ValueError, match=r"request 'zz' is unknown; add it first with runner.add_request\('zz'\)"):
        {"free_request": lambda: runner.free_request("zz"), "num_written": lambda: runner.num_written("zz"),
         "rewind": lambda: runner.rewind_request("zz", 0)}[call]()


def test_a_chunk_without_a_list_is_refused_with_the_fix(runner):
    runner.add_request("a")
    with pytest.raises(ValueError, match=r"a step is a list of TokenChunk, got one TokenChunk \(request 'a'\); pass"):
        runner.step(TokenChunk("a", 0, [1, 2]))
    assert runner.num_written("a") == 0


def test_out_of_pages_names_the_requests_that_need_them(runner):
    # 4 pages (of the tiny preset's 4 positions); two requests of 3 pages each do not fit.
    page = runner.page_size
    runner.add_request("a")
    runner.add_request("b")
    with pytest.raises(RuntimeError, match=r"step needs 6 new KV pages \(request 'a' 3, request 'b' 3\) but 4 of 4"):
        runner.step([TokenChunk("a", 0, [1] * (2 * page + 1)), TokenChunk("b", 0, [2] * (2 * page + 1))])
    assert 2 * (2 * page + 1) <= runner.max_tokens
    assert runner.num_free_pages == 4 and runner.num_written("a") == runner.num_written("b") == 0


def test_the_old_num_tokens_spelling_still_works_with_a_warning(runner):
    runner.add_request("a")
    runner.step([TokenChunk("a", 0, [1, 2, 3])])
    with pytest.warns(DeprecationWarning, match=r"runner.num_tokens\(seq_id\) is deprecated.*num_written"):
        assert runner.num_tokens("a") == 3
    assert torch.is_tensor(runner.run_chunks([TokenChunk("a", 3, [4])]))
