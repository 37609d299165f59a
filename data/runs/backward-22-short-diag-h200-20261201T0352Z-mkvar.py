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
(out / "timing_only_nostore.cu").write_text(edit(src, [
    ("  store_dk_dv<T, D, 1, D / 8>(dK", "  if (N < 0) store_dk_dv<T, D, 1, D / 8>(dK")]))
(out / "unused_empty.cu").write_text(edit(src, [
    ("blocks = (N - first + BR - 1) / BR;", "blocks = 0 * ((N - first + BR - 1) / BR);")]))
(out / "unused_one.cu").write_text(edit(src, [
    ("blocks = (N - first + BR - 1) / BR;", "blocks = min(1, (N - first + BR - 1) / BR);")]))
print(sorted(p.name for p in out.iterdir()))

# the candidate: dK and dV through shared memory (the free Q/dO ring), written by the TMA
tma = edit(src, [
    ("  CUtensorMap q, k, v, dout;\n  int3 oq, ok, ov, odo;", "  CUtensorMap q, k, v, dout, dk, dv;\n  int3 oq, ok, ov, odo, odk, odv;"),
    ("  if ((err = make_map(&maps.dout, p->dout, p->dtype, p, p->dout_strides, C::BR, &maps.odo))) return err;\n",
     "  if ((err = make_map(&maps.dout, p->dout, p->dtype, p, p->dout_strides, C::BR, &maps.odo))) return err;\n"
     "  if ((err = make_map(&maps.dk, p->dk, p->dtype, p, p->dk_strides, C::BC, &maps.odk))) return err;\n"
     "  if ((err = make_map(&maps.dv, p->dv, p->dtype, p, p->dv_strides, C::BC, &maps.odv))) return err;\n"),
    ("""  store_dk_dv<T, D, 1, D / 8>(dK + (size_t)b * gk.b + (size_t)h * gk.h, dV + (size_t)b * gv.b + (size_t)h * gv.h,
                              dk, dv, gk.n, gv.n, k0 + kw + 16 * warp, 0, N, scale, lane);
""", """  // dK_j and dV_j through shared memory: once both consumers' last products are done, the ring
  // of Q and dO is free; each thread puts its accumulators there (128-byte swizzled boxes, as
  // the TMA reads them), and one thread has the TMA write both tiles (rows past N are not
  // written).
  (void)dK; (void)dV; (void)gk; (void)gv;
  named_sync(1, 256);
  const uint32_t dKs = base_u + C::Q, dVs = dKs + BC * D * 2;
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int row = kw + 16 * warp + g + 8 * hh;
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
      const int c = 8 * n + 2 * (lane % 4);
      st_shared_u32(dKs + sw128(BC, row, c), pack2<T>(dk[0][n][2 * hh] * scale, dk[0][n][2 * hh + 1] * scale));
      st_shared_u32(dVs + sw128(BC, row, c), pack2<T>(dv[0][n][2 * hh], dv[0][n][2 * hh + 1]));
    }
  }
  fence_proxy_async();
  named_sync(1, 256);
  if (threadIdx.x == 128) {
    auto at_k = [&](int k) { return maps.odk.x == k ? k0 : maps.odk.y == k ? h : b; };
    auto at_v = [&](int k) { return maps.odv.x == k ? k0 : maps.odv.y == k ? h : b; };
#pragma unroll
    for (int blk = 0; blk < D / 64; blk++) {
      tma_store_4d(&maps.dk, dKs + blk * BC * 128, blk * 64, at_k(1), at_k(2), at_k(3));
      tma_store_4d(&maps.dv, dVs + blk * BC * 128, blk * 64, at_v(1), at_v(2), at_v(3));
    }
    bulk_commit();
    bulk_wait_read();
  }
"""),
])
(out / "v23_tmastore.cu").write_text(tma)
print("v23 written")
