"""The CPU labs' questions and how an answer is read: the registry (one lab in each of notebooks
01-03 and 05-13, three in notebook 98), each lab's prompt and the form of its answer (a whole number, a number to so
many decimals, a list of lanes, a tuple, switch names, a 64-bit value), which reads any
reasonable spelling of an answer into one canonical string: 32, "32", 32.0 and np.int64(32) are
"32"; [11, 8, 9, 10] and (8, 9, 10, 11) are "8,9,10,11". Also the format of the compiled answer
keys: how an answer is hashed, and how a message sealed with it is opened.

Plain data: this module computes no lab's answer and states none, and imports no lesson model.
flashlab.course.labs checks answers with it; flashlab.course.labkeys (the solution edition's)
compiles the keys with it.
"""
import base64
import hashlib
import math
import re
from dataclasses import dataclass

import numpy as np

from . import Exercise

POINTS = 2                  # every lab
KEYS_FORMAT = "flashlab-labkeys/1"

# What the prompts quote from the lesson models, as plain values (tests/test_labs.py checks that
# they still equal the models').
WARP = 32                                   # fragments.WARP
SECTOR = 32                                 # diagrams.SECTOR: bytes
SM90 = (65536, 2048, 32, 228 * 1024)        # tiling.SM_LIMITS["9.0"]
STAGE03_THREADS = 256                       # tiling.THREADS
SWITCH_NAMES = ("FOLD_SCALE", "SKIP_RESCALE", "WARP_SKIP", "LANE_OFFSETS", "ONE_KSTEP")
E4M3_MAX = 448.0                            # torch.finfo(torch.float8_e4m3fn).max
IB_GBS = 50.0                               # ring.LINKS_GBS["ib_ndr"]
RING_LABS = ("20_warpspec_backward", "98_ring_attention")  # handed out with stage 20


class _Unreadable(ValueError):
    """The answer is not of the kind the question asks for; the message says what it wants."""


# ---------------------------------------------------------------- the answers' forms

def _n(x) -> str:
    """12345 -> '12 345', as the notebooks write numbers."""
    return f"{x:,}".replace(",", " ")


def _join(xs):
    xs = [str(x) for x in xs]
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]


def _without_unit(text: str, what: str) -> str:
    """'N blocks' -> 'N' where the unit is the one `what` asks for ("a whole number of
    blocks"), singular or plural; any other text stays as it is."""
    m = re.fullmatch(r"\s*(\S+?)\s+([A-Za-z][A-Za-z-]*)\s*", text)
    if not m:
        return text
    unit = m.group(2).lower().rstrip("s")
    asked = {w.rstrip("s") for w in re.findall(r"[a-z]+", what.lower())} - {"a", "of", "number",
                                                                          "whole"}
    return m.group(1) if unit in asked else text


def _whole(answer, what="a whole number", fraction=None) -> int:
    """A whole number from an int, an integral float or a string of one ("0x..." too, and with
    the unit it is counted in: "N sectors"). `fraction` (with {x}) is the message for a number
    that is not whole."""
    if isinstance(answer, str):
        answer = _without_unit(answer, what)
    if isinstance(answer, (bool, np.bool_)):
        raise _Unreadable(f"the answer is {what}, not {answer!r}")
    if isinstance(answer, (int, np.integer)):  # exactly, even past 2**53 (a 64-bit descriptor)
        return int(answer)
    if isinstance(answer, str) and re.fullmatch(r"\s*0[xX][0-9a-fA-F]+\s*", answer):
        return int(answer, 16)
    if isinstance(answer, str) and re.fullmatch(r"\s*[+-]?\d+\s*", answer):
        return int(answer)                     # exactly, as for an int
    if isinstance(answer, str):
        text = answer.strip()
        if not re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)", text):
            raise _Unreadable(f"the answer is {what}, not {answer!r}")
        answer = float(text)
    try:
        x = float(answer)
    except (TypeError, ValueError):
        raise _Unreadable(f"the answer is {what}, not {answer!r}") from None
    if not math.isfinite(x):
        raise _Unreadable(f"the answer is {what}, not {answer!r}")
    if x != round(x):
        raise _Unreadable(fraction.format(x=f"{x:g}") if fraction else
                          f"the answer is {what}, not {answer!r}")
    return int(round(x))


def _number(answer, what="a number") -> float:
    if isinstance(answer, (bool, np.bool_)):
        raise _Unreadable(f"the answer is {what}, not {answer!r}")
    if isinstance(answer, str):
        answer = re.sub(r"\s*(ns|nanoseconds?)\s*$", "", answer.strip(), flags=re.I)
    try:
        x = float(answer)
    except (TypeError, ValueError):
        raise _Unreadable(f"the answer is {what}, not {answer!r}") from None
    if not math.isfinite(x):
        raise _Unreadable(f"the answer is a finite number, not {answer!r}")
    return x


def _parts(answer, n, what) -> list:
    """The n elements of a tuple answer: a tuple, list or array, or a string "(a, b)"."""
    if isinstance(answer, str):
        parts = [p for p in re.split(r"[\s,;]+", answer.strip("[](){} ")) if p]
    elif isinstance(answer, (tuple, list, np.ndarray)):
        parts = list(np.asarray(answer, dtype=object).ravel()) if isinstance(
            answer, np.ndarray) else list(answer)
    else:
        raise _Unreadable(f"the answer is {what}, not {answer!r}")
    if len(parts) != n:
        raise _Unreadable(f"the answer is {what}: {n} values, not {len(parts)} ({answer!r})")
    return parts


class Whole:
    """A whole number; canonical: its decimal digits."""

    def __init__(self, what, fraction=None):
        self.what, self.fraction = what, fraction

    def canonical(self, answer) -> str:
        return str(_whole(answer, self.what, self.fraction))

    def said(self, canon) -> str:
        return _n(int(canon))


class Hex64(Whole):
    """A 64-bit value (an int, or a string "0x..."); canonical: 0x and 16 hex digits."""

    def canonical(self, answer) -> str:
        x = _whole(answer, self.what)
        if not 0 <= x < 1 << 64:
            raise _Unreadable(f"the answer is {self.what}: 0 <= value < 2**64, not {answer!r}")
        return f"0x{x:016x}"

    def said(self, canon) -> str:
        return canon


class Number:
    """A number, rounded to `digits` decimals (a float answer with a tolerance becomes the set of
    canonical values in its window); `unit` is appended when the message names it."""

    def __init__(self, what, digits=0, unit=""):
        self.what, self.digits, self.unit = what, digits, unit

    def canonical(self, answer) -> str:
        x = round(_number(answer, self.what), self.digits)
        if self.digits == 0:
            return str(int(x))
        return f"{x + 0.0:.{self.digits}f}"      # + 0.0: no "-0.0"

    def said(self, canon) -> str:
        return f"{canon} {self.unit}".strip()


class Lanes:
    """A set of lane numbers 0..31, as a list (any order, repeats ignored); canonical: sorted,
    comma-separated."""
    what = "a list of lane numbers (0..31)"

    def canonical(self, answer) -> str:
        if isinstance(answer, str):
            parts = [p for p in re.split(r"[\s,;]+", answer.strip("[](){} ")) if p]
        elif np.ndim(answer) == 0:
            parts = [answer]
        else:
            parts = list(np.asarray(answer).ravel().tolist())
        lanes = [_whole(p, self.what) for p in parts]
        if not lanes or any(not 0 <= x < WARP for x in lanes):
            raise _Unreadable(f"the answer is a list of lane numbers 0..31, not {answer!r}")
        return ",".join(str(x) for x in sorted(set(lanes)))

    def said(self, canon) -> str:
        lanes = canon.split(",")
        return ("lane " if len(lanes) == 1 else "lanes ") + _join(lanes)


class Tuple:
    """A fixed number of values, each of its own form; canonical: "(a, b, ...)"."""

    def __init__(self, what, *forms):
        self.what, self.forms = what, forms

    def canonical(self, answer) -> str:
        parts = _parts(answer, len(self.forms), self.what)
        return "(" + ", ".join(f.canonical(p) for f, p in zip(self.forms, parts)) + ")"

    def said(self, canon) -> str:
        return canon


class Switches:
    """A set of stage 08's switch names, as a list ([] or "none" for none); canonical: sorted,
    comma-separated ("" for none)."""
    what = "a list of switch names"

    def canonical(self, answer) -> str:
        if isinstance(answer, str):
            parts = [p for p in re.split(r"[\s,;]+", answer.strip("[](){} ")) if p]
            if [p.lower() for p in parts] in (["none"], ["nothing"]):
                parts = []
        else:
            try:
                parts = list(answer)
            except TypeError:
                raise _Unreadable(f"the answer is {self.what}, not {answer!r}") from None
        out = set()
        for p in parts:
            name = str(p).strip().strip("'\"").upper()
            if name not in SWITCH_NAMES:
                raise _Unreadable(f"{p!r} is not a switch; the switches are "
                                  f"{', '.join(SWITCH_NAMES)}")
            out.add(name)
        return ",".join(sorted(out))

    def said(self, canon) -> str:
        return _join(canon.split(",")) if canon else "none"


# ---------------------------------------------------------------- the labs

@dataclass(frozen=True)
class Lab:
    exercise: Exercise
    prompt: str           # the question as the notebook shows it
    form: object          # how an answer is read: Whole, Number, Lanes, Tuple, ...


def _lab(stage, id, title, prompt, form):
    stage, notebook = stage if isinstance(stage, tuple) else (stage, "")
    return Lab(Exercise(id, stage, "lab", title, POINTS, notebook), prompt, form)


_LABS = (
    _lab("01_naive", "01.bank_wavefronts",
         "Bank wavefronts: how many wavefronts does stage 01's warp take to read Qi[t*d + x] at "
         "d = 80?",
         "In stage 01's score loop, `sum += Qi[(tx * d) + x] * Kj[(y * d) + x]`, lane t of the "
         "warp reads the float `Qi[t*d + x]`: word t·d + x of shared memory, counted in 4-byte "
         "words. Shared memory has 32 banks, 4 bytes wide: word w is in bank w mod 32, and a bank "
         "delivers one word a clock; lanes that read the same word share it (a broadcast). A "
         "request takes one pass, a wavefront, per different word in its busiest bank. At a head "
         "dim of d = 80 (the notebook's d = 64 is charged above) and x = 0, how many wavefronts "
         "does one such read of the warp take? Count it by hand, then check it with "
         "`banks.wavefronts(words)` (`from flashlab import banks`; words in 4-byte units; it "
         "returns the count and each lane's pass). Set `answer` to a whole number.",
         Whole("a whole number of wavefronts")),
    _lab("02_coalesced", "02.sectors",
         "Sectors per request: how many 32-byte sectors does one load of stage 02's warp touch "
         "when K starts 16 bytes into a sector?",
         "Stage 02's `load_tile` has thread `tid` copy elements tid, tid + 1024, ... of the tile, "
         "so one load instruction of a warp reads 32 consecutive floats (4 bytes each), lane t "
         "the t-th. Global memory moves in 32-byte sectors. Suppose K reached the kernel as a "
         "view that starts 16 bytes into its buffer (`buf[4:]` of a float32 buffer that is "
         "itself aligned), so that the first float a warp reads sits 16 bytes past a sector "
         "boundary. How many sectors does one such load instruction of the warp touch? Predict it "
         "from the lanes' byte addresses, then check it with "
         "`diagrams.sectors_per_request(addresses)`. Set `answer` to a whole number.",
         Whole("a whole number of sectors")),
    _lab("03_coarsened", "03.occupancy",
         "Occupancy: how many of stage 03's blocks fit on an SM at 64 registers a thread, with "
         "64 × 64 tiles at D = 128?",
         f"Stage 03's block has {STAGE03_THREADS} threads. At D = 128 the launch uses 32-key "
         "tiles; suppose it kept D = 64's tiles instead, 64 query rows and 64 keys (BR = BC = "
         "64), and a better compiler got the kernel down to 64 registers a thread. The block's "
         "shared memory is section 6's sum at these sizes, `tiling.smem_bytes(D, BR, BC)`: Q and K "
         "rows padded to D + 4 floats, V rows of D, P rows of BC + 4, 4 bytes a float. An H100 SM "
         f"(sm_90) has {_n(SM90[0])} registers (allocated per warp, in units of 256), room for "
         f"{_n(SM90[1])} threads and {SM90[2]} blocks, and 228 KiB = {_n(SM90[3])} bytes of shared "
         "memory, of which each block also reserves 1 KiB. How many blocks can one SM hold? Set "
         "`answer` to a whole number.",
         Whole("a whole number of blocks",
               fraction="blocks are whole, not {x}: a block that does not fit is not resident, "
                        "so each limit allows a whole number of blocks (round down)")),
    _lab("05_mma", "05.fragment_owner",
         "Fragment ownership: which lanes hold the scores of key 37 in mma's C fragments?",
         "After S = Q Kᵀ a warp holds its 16 × 64 scores as 8 `mma.sync.aligned.m16n8k16` "
         "accumulator tiles of 16 × 8, tile n holding keys 8n .. 8n + 7, each lane 4 floats "
         "c0..c3 of every tile. The causal mask compares each score's key with its row, so each "
         "lane must know which keys it holds. Which lanes hold scores of key 37 (column 37 of "
         "S)? Predict it from the ISA's rule for C (groupID = lane >> 2, threadID_in_group = "
         "lane % 4), then check it with the warp emulation (`fragments.to_fragment(tile, 'C')` "
         "on a 16 × 8 tile). Set `answer` to the lane numbers (a list).",
         Lanes()),
    _lab("06_swizzle", "06.bank_map",
         "A bank map: how many wavefronts does ldmatrix.x4 take with rows padded by 32 bytes?",
         "Stage 05 pads every shared-memory row of D = 64 halves by 16 bytes (144-byte rows) so "
         "that ldmatrix reads without bank conflicts; stage 06 swizzles instead. Suppose you "
         "padded by 32 bytes (160-byte rows). One `ldmatrix.x4` is served in four phases, one "
         "8 × 8 matrix each: 8 lanes read a 16-byte chunk from 8 consecutive rows (chunk 0 here). "
         "Shared memory has 32 banks of 4 bytes, and a phase takes one wavefront per distinct "
         "address in its busiest bank. Draw the bank map (`fragments.bank_map(144)` draws the "
         "16-byte padding's), then: how many wavefronts does one ldmatrix.x4 take (the ideal is "
         "4)? Set `answer` to a whole number.",
         Whole("a whole number of wavefronts")),
    _lab("07_cp_async", "07.pipeline_period",
         "The pipeline timeline: how long is one tile of a two-buffer loop once it is full?",
         "In stage 07's loop a K/V tile issued at time t starts arriving 500 ns later (the round "
         "trip to memory), then streams in for 200 ns (its bytes at the block's bandwidth); its "
         "math takes 300 ns. With two buffers, tile j + 1 is issued when tile j's math starts. "
         "How many ns a tile does the loop take once it is full? (Stage 06, one buffer, takes "
         "500 + 200 + 300 = 1 000 ns.) Draw it with `diagrams.pipeline_timeline` if it helps. Set "
         "`answer` to a number of ns.",
         Number("a number of ns", 0, "ns")),
    _lab("08_tuned", "08.tuning",
         "A tuning decision: which switches would a 3 % rule turn off at D = 64, causal?",
         "Stage 08's autotune times the winning shape with each of its switches (FOLD_SCALE, "
         "SKIP_RESCALE, WARP_SKIP, LANE_OFFSETS, ONE_KSTEP) switched off in turn, beside the shape "
         "with all of them on, and keeps a switch wherever switching it off lost. A difference of "
         "a few per cent is the noise between two timings, so take a stricter rule: keep a switch "
         "only where switching it off cost more than 3 % (a switch not timed stays on). Read the "
         "recorded log (`log = fl.tables.tune_log()`; `tuning.verdicts(log)` has each switch's "
         "'all_on' and 'without' scores and 'off_vs_on_pct', the change with it off): at D = 64, "
         "causal, which switches would the kernel turn off under that rule? Set `answer` to a "
         "list of switch names, [] for none.",
         Switches()),
    _lab("09_wgmma", "09.descriptor",
         "A wgmma descriptor by hand: what is V's for one k-step of P·V?",
         "Stage 09 multiplies O += P V with V read from shared memory through a descriptor "
         "(wgmma.DESCRIPTOR_FIELDS; `wgmma.encode_descriptor(addr, lead_bytes, stride_bytes)` "
         "packs one). A V tile of 128 keys at D = 128 sits at shared address 0x14000 in the "
         "128-byte swizzle (two blocks of 128 rows x 64 columns, one after the other). Give the "
         "descriptor of k-step ks = 3 (keys 48-63), as the kernel builds it. Set `answer` to the "
         "64-bit value (an int).",
         Hex64("a 64-bit descriptor (an int)")),
    _lab("10_tma", "10.parity",
         "The mbarrier ring: which buffer, and which phase parity?",
         "Take a ring like stage 10's, of STAGES = 4 buffers (stage 10's own have two or three): "
         "tile j lives in buffer "
         "j % STAGES, each buffer has a full and an empty mbarrier, each completing one phase per "
         "round of the ring, and loads run STAGES - 2 tiles ahead. At iteration j = 9: in which "
         "buffer is tile 9 and which parity do the warps wait for on its full barrier; into which "
         "buffer does the elected thread load the next tile, and with which parity does it first "
         "wait on that buffer's empty barrier? Set `answer` to (buffer, full parity, refill "
         "buffer, empty parity).",
         Tuple("four whole numbers: (buffer, full parity, refill buffer, empty parity)",
               *[Whole("a whole number")] * 4)),
    _lab("11_warpspec", "11.registers",
         "setmaxnreg: how many registers does a consumer thread get with four consumers?",
         "Stage 11's block is a producer warpgroup and CONSUMERS consumer warpgroups of 128 "
         "threads each, launched with `__launch_bounds__(THREADS, 1)` on an SM of "
         f"{_n(SM90[0])} registers (a thread's count is a multiple of 8, at most 255). Once "
         "running, the producer gives registers back with `setmaxnreg.dec` down to PRODUCER_REGS "
         "and the consumers take the rest with `setmaxnreg.inc` (a multiple of 8). Suppose the "
         "kernel ran CONSUMERS = 4 with PRODUCER_REGS = 40: how many registers may a thread hold "
         "when the kernel starts, and how many does a consumer thread hold after setmaxnreg? "
         "(`warpspec.register_budget` computes both; predict them first.) Set `answer` to "
         "(registers at launch, registers of a consumer after setmaxnreg).",
         Tuple("two whole numbers: (registers a thread at launch, registers a consumer thread "
               "after setmaxnreg)", *[Whole("a whole number of registers")] * 2)),
    _lab("12_tma_store", "12.store_sectors",
         "The end of a work item: how many sectors does a consumer's O take, both ways, at a "
         "head dim of 256?",
         "A consumer warpgroup ends a work item with its 64 x D tile of O in registers, 16-bit "
         "once packed: thread (warp w, lane = 4 g + t) holds rows 16 w + g and 16 w + g + 8, "
         "columns 8 d + 2 t and 8 d + 2 t + 1 of every 8-column tile d. Stage 11 stores each pair "
         "with one 4-byte st.global, so one warp instruction covers 8 rows of one tile d; O is "
         "row-major, 2 D bytes a row. Take a head dim of D = 256 (Gemma's; the kernels stop at "
         "128, the count does not). How many warp store instructions does the warpgroup issue; "
         "how many 32-byte sectors do they write, counted once per instruction that touches one; "
         "and how many sectors does stage 12's TMA store write for the same tile? "
         "(`tma_store.o_store_requests` counts them; predict first.) Set `answer` to "
         "(instructions, sectors from registers, sectors by the TMA).",
         Tuple("three whole numbers: (warp store instructions, sectors from registers, sectors "
               "by the TMA)", *[Whole("a whole number")] * 3)),
    _lab("13_lazy_rescale", "13.lazy_bound",
         "The lazy pass: how large can P get at a threshold of 10, and where would an FP8 P "
         "overflow?",
         "After an item's first key tile, stage 13 takes each exponential against the running "
         "maximum m as it stands, P = 2^(s - m) in log2 units, and keeps the tile only when no "
         "score s of the warp's rows exceeds m by more than a threshold (8 in the kernel); "
         "otherwise it takes the tile again the classic way, with the new maximum. Suppose a "
         "variant raised the threshold to 10 (fewer fallbacks) and passed P to the tensor cores "
         "in 8 bits, as e4m3 FP8 (largest finite value 448), as FP8 attention kernels do. What is "
         "the largest value its lazy pass can write into P, and how many log2 units above m may "
         "a score lie before its exponential no longer fits in e4m3 (to one decimal)? Set "
         "`answer` to (largest P, units above m).",
         Tuple("two numbers: (the largest P the lazy pass writes, the log2 units above m where "
               "an e4m3 P overflows)", Number("a number", 0), Number("a number", 1))),
    _lab(RING_LABS, "98.merge",
         "Merging two partial outputs: what are o and lse over both sets of keys?",
         "One query row (a head dim of 2, to keep it short) meets its keys in two disjoint parts, "
         "as two ring steps would. Over the keys of part A, attention gives o_A = (1, 0) with "
         "log-sum-exp lse_A = 0.5; over part B, o_B = (0, 2) with lse_B = 0.5 + ln 3 (natural "
         "logarithms, the scale already in the scores). What are the row's output o and "
         "log-sum-exp lse over all of its keys? Work it out by hand from section 2's formula, "
         "then check it with `ring.merge` on tensors. Set `answer` to (o[0], o[1], lse), each "
         "to three decimals.",
         Tuple("three numbers: (o[0], o[1], lse)", *[Number("a number", 3)] * 3)),
    _lab(RING_LABS, "98.balance",
         "The contiguous split under the mask: how unbalanced is it on eight ranks?",
         "Split a causal sequence contiguously over W = 8 ranks, rank r holding the r-th eighth "
         "of the queries, keys and values, and run the ring: at each step every rank computes "
         "its queries' scores against the block it holds (none of a block after its queries, "
         "half of its own, all of one before it), and the step lasts as long as its busiest "
         "rank's. What is the busiest rank's share of the scores over the average rank's, and "
         "what share of the ring's time does the average rank spend computing? Predict both, "
         "then check them with `ring.step_work` and `ring.balance`. Set `answer` to (busiest / "
         "mean, share of the time), each to two decimals.",
         Tuple("two numbers: (busiest / mean, share of the time busy)",
               *[Number("a number", 2)] * 2)),
    _lab(RING_LABS, "98.hide",
         "Across machines: how many tokens must a GPU hold to hide the ring's transfers?",
         "Take section 5's model of a ring step for a causal training step (the forward's ring "
         "and the backward's, dK and dV in fp32 travelling back with K and V), bf16, with the "
         "local attention at 500 TFLOP/s, and GPUs joined by one InfiniBand NDR port each "
         f"({IB_GBS:g} GB/s each way) instead of NVLink. What is the fewest tokens each GPU must "
         "hold for its compute to cover every transfer, and so at most how many GPUs can a ring "
         "over one sequence of 1 048 576 tokens use with its transfers still hidden? "
         "(`ring.tokens_to_hide` computes the first; predict it first.) Set `answer` to "
         "(tokens, GPUs).",
         Tuple("two whole numbers: (tokens a GPU, GPUs)", Whole("a whole number of tokens"),
               Whole("a whole number of GPUs"))),
)
_BY_ID = {lab.exercise.id: lab for lab in _LABS}
LABS = tuple(lab.exercise for lab in _LABS)


def _lab_of(id) -> Lab:
    id = getattr(id, "id", id)
    if id not in _BY_ID:
        raise ValueError(f"no lab {id!r}; the labs are: {', '.join(_BY_ID)}")
    return _BY_ID[id]


def form(id):
    """How lab `id` reads an answer: .canonical(answer) -> str, .said(canonical) -> str."""
    return _lab_of(id).form


def prompt(id) -> str:
    """The lab's question, as the notebook shows it."""
    lab = _lab_of(id)
    return f"**Lab {lab.exercise.id}** ({lab.exercise.points} points). {lab.prompt}"


# ---------------------------------------------------------------- the keys

def answer_hash(salt, id, canonical) -> str:
    """How the keys name an answer: SHA-256 of the salt, the lab and the canonical answer."""
    text = f"{KEYS_FORMAT} answer\0{salt}\0{id}\0{canonical}"
    return hashlib.sha256(text.encode()).hexdigest()


def _keystream(salt, id, canonical, n) -> bytes:
    """n bytes of SHA-256 in counter mode, keyed by the answer (another hash than answer_hash's,
    so that the stored hash does not unlock anything)."""
    key = hashlib.sha256(f"{KEYS_FORMAT} key\0{salt}\0{id}\0{canonical}".encode()).digest()
    out = b"".join(hashlib.sha256(key + i.to_bytes(8, "big")).digest()
                   for i in range((n + 31) // 32))
    return out[:n]


def _xor(data: bytes, stream: bytes) -> bytes:
    return bytes(a ^ b for a, b in zip(data, stream))


def unseal(token, salt, id, canonical) -> str:
    """A message the keys hold encrypted (base64), opened with the answer that unlocks it."""
    data = base64.b64decode(token)
    return _xor(data, _keystream(salt, id, canonical, len(data))).decode()
