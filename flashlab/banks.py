"""The shared-memory bank model every notebook counts conflicts with: 32 banks, 4 bytes wide; a
warp's request is served in passes (wavefronts) of at most 128 bytes, each holding at most one
address per bank, identical addresses broadcast."""
import numpy as np

BANKS, BANK_BYTES, WAVEFRONT_BYTES = 32, 4, 128


def wavefronts(addr, vector=1):
    """Serve one warp's shared-memory request: addr[lane] is the first 4-byte word each lane
    reads, `vector` words each (4 = float4). Identical addresses broadcast; a pass may not hold
    two different addresses in one bank, nor more than 128 bytes. Returns (passes, pass_of_lane),
    assigning distinct addresses to passes first-fit — which meets the lower bound
    max(most distinct addresses in one bank, bytes / 128) for the patterns in these kernels."""
    addr = np.asarray(addr)
    passes, pass_of = [], {}
    for a in sorted(set(addr.tolist())):
        banks = {(a + i) % BANKS for i in range(vector)}
        for p, (used, nbytes) in enumerate(passes):
            if not used & banks and nbytes + BANK_BYTES * vector <= WAVEFRONT_BYTES:
                passes[p] = (used | banks, nbytes + BANK_BYTES * vector)
                break
        else:
            p = len(passes)
            passes.append((banks, BANK_BYTES * vector))
        pass_of[a] = p
    return len(passes), np.array([pass_of[a] for a in addr.tolist()])
