"""kiln's kernels built with AddressSanitizer and UBSan (KILN_NATIVE_SANITIZE, a separate cache) pass a
representative subset of the kernel tests in a subprocess with the sanitizer runtime preloaded; a canary
overflow shows the sanitizer is really there. Skipped where the compiler has no sanitizer runtime."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [   # GEMM / 1x1 / direct convolution, Winograd, LayerNorm, attention, pooling, Resize, reformat,
                   # row copies, softmax and LayerNorm (FP32, INT8), NCHW 1x1 planes, pointwise, table lookups, INT8
    "tests/tactics/test_conv1x1.py::test_matches_float64_convolution",
    "tests/tactics/test_conv1x1.py::test_batched_product_with_separate_weights_per_batch",
    "tests/tactics/test_conv_direct.py::test_matches_float64_convolution",
    "tests/tactics/test_gemm_bf16.py::test_bf16_direct_convolution_matches_its_formula",   # AMX emulated, vdpbf16ps
    "tests/tactics/test_gemm_bf16.py::test_bf16_linear_matches_its_formula",   # GELU in the epilogue
    "tests/tactics/test_linear_residual.py::test_kiln_gemm_writes_over_a_dead_residual_of_its_output_type",
    "tests/tactics/test_gemm_amx.py::test_bf16_storage_reads_and_writes_as_the_vdpbf16ps_kernel_does",
    "tests/tactics/test_winograd.py::test_compiled_blocking_matches_float64",
    "tests/tactics/test_winograd.py::test_donated_residual_is_overwritten_with_the_same_result",
    "tests/tactics/test_layernorm_c.py::test_engine_layernorm_matches_onnxruntime",
    "tests/passes/test_rms_norm.py::test_the_kernel_matches_the_formula",
    "tests/tactics/test_groupnorm_c.py::test_matches_float64",
    "tests/tactics/test_groupnorm_c.py::test_fused_activation_and_both_layouts_match_float64",
    "tests/tactics/test_groupnorm_c.py::test_channel_major_bf16_storage_computes_in_fp32",   # skipped without BF16
    "tests/tactics/test_attention_c.py::test_fp32_matches_the_formula_for_odd_sizes",
    "tests/tactics/test_attention_c.py::test_fp32_math_reads_and_writes_bf16_as_the_plan_stores_it",
    "tests/tactics/test_attention_c.py::test_bf16_math_matches_the_formula_on_bf16_operands",   # skipped without BF16
    "tests/tactics/test_attention_decoder.py::test_grouped_query_attention_reads_each_kv_head_in_place",
    "tests/tactics/test_attention_decoder.py::test_causal_masks_match_the_formula_with_their_dead_keys_skipped",
    "tests/tactics/test_rotary_c.py::test_fp32_matches_the_formula",
    "tests/tactics/test_rotary_c.py::test_bf16_storage_computes_in_fp32_and_rounds_once",
    "tests/tactics/test_pool_c.py::test_maxpool_equals_onnxruntime",
    "tests/tactics/test_pool_c.py::test_global_pools_equal_torch",
    "tests/tactics/test_resize_c.py::test_matches_onnxruntime_exactly",
    "tests/tactics/test_resize_interpolate.py::test_matches_onnxruntime_in_both_layouts",
    "tests/tactics/test_reformat.py::test_both_directions_are_exact",
    "tests/tactics/test_copy_c.py::test_fp32_concat_equals_torch_cat",
    "tests/tactics/test_shuffle_c.py::test_large_tiles_and_runs_are_shared_among_threads_exactly",
    "tests/tactics/test_shuffle_c.py::test_random_step_chains_equal_the_reference_bit_for_bit",
    "tests/tactics/test_conv1d_direct.py::test_every_geometry_matches_float64",
    "tests/tactics/test_copy_c.py::test_concat_equals_torch_cat_in_every_storage",   # skipped without BF16
    "tests/tactics/test_softmax_c.py::test_fp32_equals_torch_on_every_axis",
    "tests/tactics/test_softmax_c.py::test_bf16_storage_computes_in_fp32",
    "tests/tactics/test_softmax_int8.py::test_the_kernel_quantizes_the_softmax_of_the_dequantized_row",
    "tests/tactics/test_layernorm_int8.py::test_the_residual_sum_is_rounded_to_int8_before_the_norm",
    "tests/tactics/test_lookup_c.py::test_the_kernel_maps_every_byte_through_its_table",
    "tests/precision/test_dynamic_quant.py::test_the_kernel_equals_onnxruntime_at_the_edges_of_the_range",
    "tests/precision/test_dynamic_quant_conv.py::test_the_kernel_pads_with_the_calls_zero_point_as_onnxruntime",
    "tests/tactics/test_conv_planes.py::test_fp32_matches_torch",
    "tests/tactics/test_conv_planes.py::test_bf16_storage_computes_in_fp32",
    "tests/tactics/test_codegen.py::test_unary_ops_match_onnxruntime",
    "tests/tactics/test_codegen.py::test_binary_ops_with_broadcast_match_onnxruntime",
    "tests/tactics/test_codegen_shaped.py::test_an_attention_mask_add_follows_each_calls_batch_and_length",
    "tests/tactics/test_codegen_shaped.py::test_a_per_channel_program_keeps_the_callers_layout_for_any_batch",
    "tests/tactics/test_qgemm_c.py::test_quantized_conv_matches_its_formula_and_onednn",   # skipped without VNNI
    "tests/tactics/test_qgemm_c.py::test_quantized_linear_matches_its_formula_and_onednn",
    "tests/tactics/test_qgemm_tables.py::test_an_output_table_maps_each_stored_byte",
    "tests/tactics/test_qgemm_tables.py::test_a_convolution_with_an_output_table_stores_each_mapped_byte",
    "tests/tactics/test_qgemm_tables.py::test_an_output_table_after_onednns_call_maps_every_byte",
    "tests/tactics/test_qgemm_act.py::test_product_of_two_int8_activations_equals_its_formula",
    "tests/tactics/test_qgemm_amx.py::test_quantized_conv_equals_the_vnni_kernel",   # AMX emulated
    "tests/tactics/test_qgemm_amx.py::test_quantized_linear_equals_the_vnni_kernel",
]
CANARY = """
import torch
from kiln import native
x, y = torch.randn(1, 8, 4, 4), torch.empty(8 * 4 * 4 - 1)   # one float short
native.library("reformat").kiln_to_nhwc(x.data_ptr(), y.data_ptr(), 1, 8, 16, 0)
"""


def sanitizer_runtime(compiler: str) -> str:
    done = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=30)
    path = done.stdout.strip()
    if done.returncode != 0 or not os.path.isabs(path) or not os.path.exists(path):
        pytest.skip(f"{compiler} has no AddressSanitizer runtime (-print-file-name=libasan.so gave {path!r}); "
                    "install libasan (e.g. apt-get install libgcc-12-dev) to run the kernels under sanitizers")
    return path


def sanitized_run(args: list[str], runtime: str, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    # No use-after-return fake stacks: libasan before LLVM's fix of August 2025 (llvm-project#152819, relanded as
    # #153142; gcc 13's runtime turns them on by default, gcc 12's does not) misaligns their frames, and a 64-byte
    # aligned local stored with vmovaps zmm faults there where nothing is out of bounds. Other checks stay on.
    env.update(LD_PRELOAD=runtime, KILN_NATIVE_SANITIZE="1", KILN_CACHE_DIR=str(cache),
               ASAN_OPTIONS="detect_leaks=0:detect_stack_use_after_return=0", UBSAN_OPTIONS="print_stacktrace=1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_kernel_tests_pass_under_address_and_undefined_behaviour_sanitizers(compiler, tmp_path):
    runtime = sanitizer_runtime(compiler.compiler)
    canary = sanitized_run(["-c", CANARY], runtime, tmp_path)
    # A 64-byte store past the end is a "heap-buffer-overflow"; a 32-byte one (AVX2 builds) straddling it, an
    # "unknown-crash": either way ASan places it just past the 127 floats.
    report = canary.stderr
    assert canary.returncode != 0 and "ERROR: AddressSanitizer" in report, report[-2000:]
    assert "0 bytes to the right of 508-byte region" in report and "kiln_to_nhwc" in report, report[-2000:]

    done = sanitized_run(["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS], runtime, tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "AddressSanitizer" not in output and "runtime error:" not in output, output[-4000:]
    built = sorted(p.name.split("-")[0] for p in (tmp_path / "kernels-sanitized").glob("*.so"))
    libraries = {"gemm", "winograd", "layernorm", "attention", "pool", "resize", "reformat", "pointwise", "rotary"}
    assert libraries <= set(built), built
    assert not (tmp_path / "kernels").exists()   # sanitized builds never mix with the normal ones
