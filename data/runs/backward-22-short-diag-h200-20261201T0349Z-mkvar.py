"""Variants of stage 22's kernel for the short-sequence diagnosis (written into .s22/var/)."""
from pathlib import Path
src = Path("kernels/22_overlap_backward.cu").read_text()
out = Path(".s22/var"); out.mkdir(exist_ok=True)

def edit(text, pairs):
    for old, new in pairs:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text

kfirst = edit(src, [
    ("static constexpr int BYTES = BARS + 9 * 8 + 1024;", "static constexpr int BYTES = BARS + 10 * 8 + 1024;"),
    ("const uint32_t dq_full = q_empty + 16, dq_empty = dq_full + 16;",
     "const uint32_t dq_full = q_empty + 16, dq_empty = dq_full + 16, v_full = dq_empty + 16;"),
    ("    mbar_init(kv_full, 1);\n", "    mbar_init(kv_full, 1);\n    mbar_init(v_full, 1);\n"),
    ("      mbar_arrive_expect_tx(kv_full, 2 * C::KV_BYTES);", "      mbar_arrive_expect_tx(kv_full, C::KV_BYTES);"),
    ("      tma_tile<BC, D>(Vs, maps.v, kv_full, k0, h, b, maps.ov);\n", ""),
    ("        bulk_load(base_u + C::DL + s * BR * 4, delta + q0, BR * 4, full);\n",
     "        bulk_load(base_u + C::DL + s * BR * 4, delta + q0, BR * 4, full);\n"
     "        if (i == 0) { mbar_arrive_expect_tx(v_full, C::KV_BYTES); tma_tile<BC, D>(Vs, maps.v, v_full, k0, h, b, maps.ov); }\n"),
    ("    wgmma_commit();\n#pragma unroll\n    for (int kk = 0; kk < KD; kk++)\n      wgmma_ss<T, BR>(dpt_acc,",
     "    wgmma_commit();\n    if (i == 0) mbar_wait(v_full, 0);\n#pragma unroll\n    for (int kk = 0; kk < KD; kk++)\n      wgmma_ss<T, BR>(dpt_acc,"),
])
(out / "v22_kfirst.cu").write_text(kfirst)
(out / "timing_only_nostore.cu").write_text(edit(src, [
    ("  store_dk_dv<T, D, 1, D / 8>(dK", "  if (N < 0) store_dk_dv<T, D, 1, D / 8>(dK")]))
(out / "timing_only_empty.cu").write_text(edit(src, [
    ("blocks = (N - first + BR - 1) / BR;", "blocks = 0 * ((N - first + BR - 1) / BR);")]))
(out / "timing_only_one.cu").write_text(edit(src, [
    ("blocks = (N - first + BR - 1) / BR;", "blocks = min(1, (N - first + BR - 1) / BR);")]))
print(sorted(p.name for p in out.iterdir()))
