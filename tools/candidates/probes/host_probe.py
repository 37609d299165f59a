"""Host time per call of flashlab's call path, old package (argv[1] = its root) or new; one
process per package. Prints one table."""
import statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import flashlab as fl
from flashlab import model
from flashlab.check import case_inputs
print("package", fl.__file__)

def host(fn, calls=100):
    # bench.host_ms's measurement, written out: the package before the change has no host_ms
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(40 * 2_000_000))
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6

rows = []
B, H, N, D = 8, 12, 1024, 64
for slug in ("08_tuned", "13_lazy_rescale"):
    attn = fl.stage(slug).build()
    q, k, v, _ = case_inputs(B, H, N, D, torch.float16, "bnhd")
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    out = torch.empty(B, N, H, D, dtype=q.dtype, device="cuda").transpose(1, 2)
    ad = model.SDPA(attn)
    st = attn.stage
    rows.append((slug, "call, contiguous", host(lambda: attn(qc, kc, vc, causal=True))))
    rows.append((slug, "call, model layout + out", host(lambda: attn(q, k, v, causal=True, out=out))))
    rows.append((slug, "SDPA adapter, model layout", host(lambda: ad(q, k, v, is_causal=True))))
    rows.append((slug, "validate", host(lambda: fl.inputs.validate(slug, q, k, v, st.dtypes, out, row_strides=True))))
    m = attn.module
    rows.append((slug, "module.unsupported", host(lambda: m.unsupported(B, H, N, D, 1, True))))
    rows.append((slug, "module.workspace_bytes", host(lambda: m.workspace_bytes(B, H, N, D, 1, True))))
    lay = tuple(fl.inputs.strides(t) for t in (q, k, v, out))
    ws = torch.zeros(16, dtype=torch.uint8, device="cuda")
    s = torch.cuda.current_stream().cuda_stream
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), ws.data_ptr(), B, H, N, D, 1, True, D ** -0.5, s, lay)
    rows.append((slug, "module.launch alone", host(lambda: m.launch(*args))))
sdpa = torch.nn.functional.scaled_dot_product_attention
rows.append(("torch", "F.sdpa, model layout", host(lambda: sdpa(q, k, v, is_causal=True))))
rows.append(("torch", "F.sdpa, contiguous", host(lambda: sdpa(qc, kc, vc, is_causal=True))))
def ctx():
    with torch.cuda.device(q.device):
        pass
rows.append(("torch", "torch.cuda.device() enter+exit", host(ctx)))
rows.append(("torch", "current_stream().cuda_stream", host(lambda: torch.cuda.current_stream(q.device).cuda_stream)))
rows.append(("torch", "torch.empty_like(q)", host(lambda: torch.empty_like(q))))
rows.append(("torch", "torch.empty(4 bytes)", host(lambda: torch.empty(4, dtype=torch.uint8, device="cuda"))))
rows.append(("torch", "strides of 4 tensors", host(lambda: tuple(fl.inputs.strides(t) for t in (q, k, v, out)))))
for who, what, us in rows:
    print(f"{who:16} {what:34} {us:7.1f} us")
