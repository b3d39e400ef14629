"""Frozen-value detection's comparison of two captures (CPU: synthetic graph nodes)."""

import struct

from graphcap.verify.frozen import compare_segments, param_difference
from graphcap.verify.graph_nodes import GraphNode

BASE = 0x7F00_0000_0000


def is_pointer(x: int) -> bool:  # stands in for the driver query on the GPU
    return BASE <= x < BASE + 2**32


def ptr(x: int) -> bytes:
    return struct.pack("<Q", BASE + x)


def kernel(name="k", params=(), launch=(8, 1, 1, 128, 1, 1, 0)):
    return GraphNode("kernel", name, launch, tuple(params))


def test_identical_and_relocated_pointers_agree():
    a = [[kernel(params=[ptr(0), ptr(64), struct.pack("<i", 1000)])]]
    b = [[kernel(params=[ptr(4096), ptr(8192), struct.pack("<i", 1000)])]]
    assert compare_segments(a, a, ["segment 0"], is_pointer) == []
    assert compare_segments(a, b, ["segment 0"], is_pointer) == []


def test_a_scalar_that_differs_is_reported_with_segment_kernel_and_parameter():
    a = [[kernel("mul", [struct.pack("<f", 2.0)])], [kernel("add_k", [ptr(0), struct.pack("<f", 2.0)])]]
    b = [[kernel("mul", [struct.pack("<f", 2.0)])], [kernel("add_k", [ptr(8), struct.pack("<f", 3.0)])]]
    problems = compare_segments(a, b, ["segment 0 (after the start)", "segment 1 (after splice 'attn')"], is_pointer)
    assert len(problems) == 1
    assert "segment 1 (after splice 'attn')" in problems[0] and "add_k" in problems[0] and "parameter 1" in problems[0]


def test_a_scalar_packed_in_a_struct_next_to_pointers_is_found():
    """TensorIterator-style functors pass pointers and scalars in one by-value struct."""
    a = ptr(0) + ptr(16) + struct.pack("<ff", 1.0, 2.0)
    assert param_difference(a, ptr(512) + ptr(528) + struct.pack("<ff", 1.0, 2.0), is_pointer) is None
    assert param_difference(a, ptr(512) + ptr(528) + struct.pack("<ff", 1.0, 2.5), is_pointer) is not None
    # A 4-byte tail (odd-sized struct) must match exactly.
    assert param_difference(ptr(0) + b"\x01\x00\x00\x00", ptr(8) + b"\x02\x00\x00\x00", is_pointer) is not None
    # An int that happens to differ is not a pointer, even if the other side is one.
    assert param_difference(ptr(0), struct.pack("<Q", 5), is_pointer) is not None


def test_launch_name_and_structure_differences_are_reported():
    one = [[kernel(launch=(8, 1, 1, 128, 1, 1, 0))]]
    assert "launch" in compare_segments(one, [[kernel(launch=(9, 1, 1, 128, 1, 1, 0))]], ["s0"], is_pointer)[0]
    assert "second capture ran other" in compare_segments(one, [[kernel("other")]], ["s0"], is_pointer)[0]
    assert "graph nodes" in compare_segments(one, [[kernel(), kernel()]], ["s0"], is_pointer)[0]
    assert "segments" in compare_segments(one, one * 2, ["s0", "s1"], is_pointer)[0]
    unknown = [[GraphNode("kernel", "k", (8, 1, 1, 128, 1, 1, 0), None)]]
    assert compare_segments(unknown, one, ["s0"], is_pointer) == []  # sizes unknown: name and launch only


def test_memset_values_are_compared():
    a = [[GraphNode("memset", "memset", (4, 256, 1), (b"\x00" * 4,))]]
    b = [[GraphNode("memset", "memset", (4, 256, 1), (b"\x01\x00\x00\x00",))]]
    assert compare_segments(a, a, ["s0"], is_pointer) == []
    assert "parameter 0" in compare_segments(a, b, ["s0"], is_pointer)[0]


def test_bytes_that_change_between_captures_of_the_same_data_are_noise():
    """Uninitialised padding inside a by-value struct differs from capture to capture; a
    capture of the same data shows it, so only stable bytes count."""
    a = [[kernel(params=[struct.pack("<ii", 4, 0x1234) + struct.pack("<f", 2.0) + b"\0" * 4])]]
    same = [[kernel(params=[struct.pack("<ii", 4, 0x9999) + struct.pack("<f", 2.0) + b"\0" * 4])]]
    garbage_only = [[kernel(params=[struct.pack("<ii", 4, 0x7777) + struct.pack("<f", 2.0) + b"\0" * 4])]]
    frozen = [[kernel(params=[struct.pack("<ii", 4, 0x7777) + struct.pack("<f", 3.0) + b"\0" * 4])]]
    assert compare_segments(a, garbage_only, ["s0"], is_pointer) != []  # without the noise model
    assert compare_segments(a, garbage_only, ["s0"], is_pointer, same_data=same) == []
    problems = compare_segments(a, frozen, ["s0"], is_pointer, same_data=same)
    assert len(problems) == 1 and "bytes 8..15" in problems[0]


def test_a_difference_must_also_be_stable_in_the_other_datas_twin():
    a = [[kernel(params=[struct.pack("<ii", 4, 0x1234)])]]
    b = [[kernel(params=[struct.pack("<ii", 4, 0x5555)])]]
    b_again = [[kernel(params=[struct.pack("<ii", 4, 0x6666)])]]
    assert compare_segments(a, b, ["s0"], is_pointer, same_data=a) != []
    assert compare_segments(a, b, ["s0"], is_pointer, same_data=a, second_again=b_again) == []
    assert compare_segments(a, b, ["s0"], is_pointer, same_data=a, second_again=b) != []


# Real Itanium mangled names (g++ 13 of a copy of torch's signatures): torch's contiguous
# elementwise kernel takes four empty policy structs (parameters 3-6) by value; the other
# kernel takes a bool flag and a char.
ELEMENTWISE = ("_ZN2at6native27unrolled_elementwise_kernelIZNS0_11direct_copyEvEUlfE_St5arrayIPcLm2EE23TrivialOffset"
               "CalculatorILi1EjES7_NS0_6memory15LoadWithoutCastENS8_16StoreWithoutCastEEEviT_T0_T1_T2_T3_T4_")
FLAG = "_ZN2at6native11flag_kernelIcEEvibT_"


def test_kernel_parameter_types_come_from_the_mangled_name():
    from graphcap.verify.kernel_types import demangle, split_parameters, stateless_params

    sig = demangle(ELEMENTWISE)
    assert sig is not None and sig.startswith("void at::native::unrolled_elementwise_kernel<")
    params = split_parameters(sig)
    assert params[0] == "int" and params[2] == "std::array<char*, 2ul>"
    assert params[3] == "TrivialOffsetCalculator<1, unsigned int>"
    assert params[5] == "at::native::memory::LoadWithoutCast"
    assert stateless_params(ELEMENTWISE, 7) == {3, 4, 5, 6}
    assert stateless_params(ELEMENTWISE, 6) == frozenset()  # the driver disagrees: skip nothing
    assert split_parameters(demangle(FLAG)) == ["int", "bool", "char"] and stateless_params(FLAG, 3) == frozenset()
    assert demangle("_moe_gate_up_kernel") is None and stateless_params("_moe_gate_up_kernel", 3) == frozenset()


def test_an_empty_struct_parameter_is_not_a_frozen_value_but_a_bool_flag_is():
    """The H200 false positive: TrivialOffsetCalculator's one uninitialised byte held 41 in
    one capture and 42 in the other, stable within each data set."""
    def nodes(name, byte, n=7):
        params = [struct.pack("<i", 64), b"\x00", ptr(0) + ptr(64), bytes([byte]), b"\x00", b"\x00", b"\x00"][:n]
        return [[kernel(name, params=params)]]

    a, b = nodes(ELEMENTWISE, 41), nodes(ELEMENTWISE, 42)
    assert compare_segments(a, b, ["segment 0"], is_pointer, same_data=a, second_again=b) == []
    flag_a = [[kernel(FLAG, params=[struct.pack("<i", 64), b"\x01", b"c"])]]
    flag_b = [[kernel(FLAG, params=[struct.pack("<i", 64), b"\x00", b"c"])]]
    problems = compare_segments(flag_a, flag_b, ["segment 0"], is_pointer, same_data=flag_a, second_again=flag_b)
    assert len(problems) == 1 and "parameter 1" in problems[0]
