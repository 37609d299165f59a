"""The stages of the workbook, in order: the registry, every per-stage fact as plain data.

No torch here: what needs the GPU or the compiler (building a stage, asking what this machine
has) is in flashlab.runtime, which a Stage's build() and unavailable() reach when called."""
import re
from dataclasses import dataclass, field

from .paths import KERNELS, kernel_inputs

# Machine-code facts every stage shares (flashlab.sass categories: True = present in every kernel
# of the stage, False = absent from all): exp through MUFU.EX2, fp32 FMAs, nothing spilled.
COMMON_SASS = {"MUFU.EX2": True, "FFMA": True, "LDL": False, "STL": False}
# Beyond its stage's evidence, a forward kernel compiled to write the log-sum-exp (WITH_LSE) stores it.
LSE_SASS = {"STG": True}


def template_args(kernel: str) -> list:
    """'tuned_kernel<__half, 64, 128, 4, 2, 2, false, 29>(...)' -> ['__half', '64', '128', ...];
    [] for a kernel that is not a template."""
    m = re.match(r"(?:void\s+)?\w+<([^()]*)>", kernel.strip())
    return [a.strip() for a in m.group(1).split(",")] if m else []


def _nvcc_missing() -> bool:
    from .build import nvcc
    return nvcc() is None


def _cc(capability) -> str:
    """(7, 5) -> "7.5"."""
    return ".".join(map(str, capability))


@dataclass(frozen=True)
class Variant:
    """A stage's kernel changed by a patch beside it in kernels/ (flashlab.variants builds it):
    an idea a notebook runs and times against its stage without it becoming a stage."""
    stage: int             # the stage it patches, is checked like and is timed beside
    name: str              # e.g. "ping_pong"
    patch: str             # its file in kernels/ (made on the stage's kernel, regions collapsed)
    shapes: str            # its pick(): "D64:<template args after T, D>;D128:..." (variants.with_pick)
    kernel: str            # its __global__ function
    what: str              # one line: what it changes

    @property
    def slug(self) -> str:
        """How its rows and profiles are named: "12_tma_store+ping_pong"."""
        return f"{stage(self.stage).slug}+{self.name}"


@dataclass(frozen=True)
class Stage:
    """Everything flashlab knows about one stage. Tools and tests iterate these entries; adding a
    stage is its kernels/NN_slug.cu, one entry in _STAGES and its notebook source."""
    number: int
    slug: str              # e.g. "03_coarsened": the .cu file, the notebook and the results rows
    title: str
    idea: str              # the one technique this stage adds
    dtypes: tuple          # input dtypes it takes: "fp32", "fp16", "bf16"
    head_dims: tuple       # head dims it is checked and timed at
    any_head_dim: bool     # True: every D that fits in shared memory also works
    kernel: str            # its __global__ function (profilers and the SASS lookups select it)
    template: tuple = ()   # the kernel's template parameters in order: "T" (element type), "D"
    #                        (head dim), tile sizes...: how a kernel name says which one runs;
    #                        "WITH_LSE" last where the log-sum-exp's stores are compiled in only
    #                        for a forward asked for it (the kernel without them is unchanged)
    picks: bool = False    # True: a pick() table in the .cu chooses the other template arguments
    #                        per head dim, mask and N (stage 08's autotune writes it)
    causal: bool = True    # supports causal masking
    fast: bool = False     # worth timing over the FlashAttention paper's sweep
    min_cc: tuple = (8, 0)  # the lowest compute capability it builds for
    dtype_min_cc: dict = field(default_factory=dict, compare=False)  # {dtype: compute capability}
    #                        for a dtype that needs more than min_cc (04: fp16 WMMA runs on 7.5,
    #                        bf16 WMMA needs 8.0); min_cc_of(dtype) says what one dtype needs
    row_strides: bool = False  # reads any (B, H, N, D) view with a contiguous last dim (the
    #                        FlashlabLayout strides), such as transformers' views of (B, N, H, D)
    #                        projections; False: contiguous tensors only
    arch_specific: bool = False  # needs sm_XXa (wgmma, setmaxnreg): exactly min_cc's architecture
    idea_metrics: tuple = ()  # Nsight Compute metrics (flashlab.profile_schema) its idea moves
    sass: dict = field(default_factory=dict, compare=False)  # machine-code evidence beyond COMMON_SASS
    builds_on: object = None  # the number of the stage it improves on, diffs against and is timed
    #                        beside; None: the one before it in order (the first stage: nothing)
    variants: tuple = ()   # Variant entries: ideas its notebook runs beside it (flashlab.variants)
    lse: bool = False      # its forward can return the row log-sum-exp: attn(..., return_lse=True)
    backward: str = ""     # the __global__ function of its backward pass ("": it has none); the
    #                        .cu file then defines flashlab_backward_launch (kernels/flashlab.h)
    backward_sass: dict = field(default_factory=dict, compare=False)  # machine-code evidence of
    #                        the backward kernel beyond COMMON_SASS (`sass` is the forward's)
    deterministic: bool = False  # its backward gives the same bits on every run (the checks
    #                        run it again and compare)
    overlapped_waits: dict = field(default_factory=dict, compare=False)  # {head dim: n}: its
    #                        backward kernel at that head dim waits for wgmma groups with some
    #                        still running (wgmma.wait_group 1 or more: WARPGROUP.DEPBAR.LE gsb0,
    #                        0x1..) at least n times, the evidence of products overlapped with
    #                        the arithmetic between them, which a check cannot see
    grad_strides: bool = False  # its backward reads dO and writes dq, dk and dv with any row
    #                        strides (the problem's dout_strides, dq_strides..): a model's dO is
    #                        read where it lies and new gradients come in the order of q, k and v
    #                        (inputs.empty_in_order), no permuting copy either way; False: dO and
    #                        the gradients contiguous

    @property
    def name(self) -> str:
        return self.slug

    @property
    def source(self):
        return KERNELS / f"{self.slug}.cu"

    @property
    def text(self) -> str:
        """Its .cu file's text, then that of each stage file it includes whole (stages 19-21
        include stage 13's for their forward): where its kernels and pick() tables are found."""
        included = [p for p in kernel_inputs(self.source)[1:] if p.suffix == ".cu"]
        return "\n".join([self.source.read_text(), *(p.read_text() for p in included)])

    def takes(self, cfg) -> bool:
        """Whether the stage runs at this config: its dtype, its head dim and its mask."""
        return (cfg.dtype in self.dtypes and (self.any_head_dim or cfg.D in self.head_dims)
                and (self.causal or not cfg.causal))

    @property
    def sass_evidence(self) -> dict:
        """{SASS category: must appear (True) / must not (False)} in every forward kernel of the
        stage (every kernel of a stage without a backward)."""
        return {**COMMON_SASS, **self.sass}

    @property
    def has_backward(self) -> bool:
        return bool(self.backward)

    @property
    def backward_prefix(self) -> str:
        """What the name of every kernel of its backward pass contains (bwd_kernel and the passes
        around it, bwd_preprocess_kernel and bwd_dq_kernel: "bwd"): how compute-sanitizer
        selects them. "" for a stage without a backward."""
        return self.backward.removesuffix("_kernel")

    def evidence_for(self, kernel: str) -> dict:
        """The SASS evidence one of its kernels ('tuned_kernel<__half, 64, ...>' or the bare name)
        is held to: sass_evidence for the forward kernel; for the backward kernel COMMON_SASS and
        backward_sass; for the backward's small passes around it (Δ, the dQ conversion) only
        that nothing spills."""
        name = kernel.split("<")[0].split("(")[0].strip().removeprefix("void ").strip()
        if self.writes_lse(kernel):
            return {**self.sass_evidence, **LSE_SASS}
        if name == self.kernel or not self.backward:
            return self.sass_evidence
        if name == self.backward:
            return {**COMMON_SASS, **self.backward_sass}
        return {"LDL": False, "STL": False}

    def writes_lse(self, kernel: str) -> bool:
        """Whether `kernel` (a name as ptxas or cuobjdump print it) is the forward compiled to
        write the log-sum-exp too (template argument WITH_LSE true), which runs only when the
        log-sum-exp is asked for; the lessons read the kernel without it."""
        return ("WITH_LSE" in self.template and self.is_forward(kernel)
                and dict(zip(self.template, template_args(kernel))).get("WITH_LSE") == "true")

    def plain_name(self, kernel: str) -> str:
        """A kernel name as the lessons write it: without the WITH_LSE argument of a forward that
        has one ('mma_kernel<__half, 64, 64, 64, false>' -> 'mma_kernel<__half, 64, 64, 64>');
        other names as they are."""
        if "WITH_LSE" not in self.template or not self.is_forward(kernel):
            return kernel
        return re.sub(r",\s*(?:true|false)>", ">", kernel, count=1)

    def is_forward(self, kernel: str) -> bool:
        """Whether `kernel` (a name as ptxas or cuobjdump print it) is the stage's forward kernel."""
        name = kernel.split("<")[0].split("(")[0].strip().removeprefix("void ").strip()
        return name == self.kernel

    def arch(self, capability) -> str:
        """The nvcc architecture to build for on a GPU of `capability` ((9, 0) -> "sm_90", or
        "sm_90a" for an arch-specific stage)."""
        major, minor = capability
        return f"sm_{major}{minor}" + ("a" if self.arch_specific else "")

    @property
    def static_archs(self) -> tuple:
        """The architectures its machine code is read for without a GPU (ptxas's resources, the
        SASS evidence, data/sass.csv, the compile tests): sm_80 and sm_90, or for an
        arch-specific stage its one target (sm_90a: wgmma exists nowhere else)."""
        return (self.arch(self.min_cc),) if self.arch_specific else ("sm_80", "sm_90")

    def min_cc_of(self, dtype) -> tuple:
        """The lowest compute capability this stage runs `dtype` on: min_cc, or more where
        dtype_min_cc says so (stage 04: (7, 5) for fp16, (8, 0) for bf16)."""
        return max(tuple(self.min_cc), tuple(self.dtype_min_cc.get(dtype, self.min_cc)))

    def dtypes_on(self, capability) -> tuple:
        """The dtypes it runs on a GPU of `capability`, in the registry's order."""
        return tuple(dt for dt in self.dtypes if tuple(capability) >= self.min_cc_of(dt))

    def unavailable(self, capability=None, toolkit=True, dtype=None):
        """None when this stage (in `dtype`, if given) can be built and run here, else why not,
        in one sentence: no GPU, a GPU below min_cc (or, for an arch-specific stage, not exactly
        min_cc), a GPU below what `dtype` needs ("04_wmma bf16 needs compute capability 8.0 or
        newer; this GPU is 7.5"), no nvcc, or no kernel file (an edition that ends before this
        stage). Without `dtype` a stage is available where any of its dtypes runs;
        unavailable_dtypes() names the ones that do not."""
        if not self.source.is_file():  # an edition of an assignment before this stage
            return f"kernels/{self.slug}.cu is not in this edition"
        if capability is None:
            from .runtime import capability as _here
            capability = _here()
            if capability is None:
                return "no CUDA GPU here"
        need = _cc(self.min_cc)
        have = _cc(capability)
        if self.arch_specific and tuple(capability) != tuple(self.min_cc):
            return f"{self.slug} uses instructions of compute capability {need} only; this GPU is {have}"
        if tuple(capability) < tuple(self.min_cc):
            return f"{self.slug} needs compute capability {need} or newer; this GPU is {have}"
        if dtype is not None and dtype not in self.dtypes:
            return f"{self.slug} takes {' or '.join(self.dtypes)}, not {dtype}"
        if dtype is not None and tuple(capability) < self.min_cc_of(dtype):
            return (f"{self.slug} {dtype} needs compute capability {_cc(self.min_cc_of(dtype))} or "
                    f"newer; this GPU is {have}")
        if toolkit and _nvcc_missing():
            return f"building {self.slug} needs nvcc (the CUDA toolkit), which is not installed here"
        return None

    def unavailable_dtypes(self, capability=None) -> dict:
        """{dtype: why} for each dtype this stage cannot run on a GPU where it runs otherwise
        (stage 04 on a T4: {"bf16": "04_wmma bf16 needs compute capability 8.0 or newer; this GPU
        is 7.5"}); {} where it runs in every dtype, or does not run at all (unavailable() says
        why)."""
        if capability is None:
            from .runtime import capability as _here
            capability = _here()
            if capability is None:
                return {}
        if self.unavailable(capability, toolkit=False) is not None:
            return {}
        return {dt: why for dt in self.dtypes
                if (why := self.unavailable(capability, toolkit=False, dtype=dt)) is not None}

    def availability(self, capability=None) -> str:
        """One line for a listing: "runs live", "runs live in fp16; <why not bf16>" or
        "replayed: <why>"."""
        why = self.unavailable(capability)
        if why is not None:
            return f"replayed: {why}"
        missing = self.unavailable_dtypes(capability)
        if not missing:
            return "runs live"
        runs = [dt for dt in self.dtypes if dt not in missing]
        return f"runs live in {'/'.join(runs)}; " + "; ".join(missing.values())

    def variant(self, name) -> Variant:
        """One of its variants by name; ValueError naming those there are."""
        for v in self.variants:
            if v.name == name:
                return v
        have = ", ".join(v.name for v in self.variants) or "none"
        raise ValueError(f"{self.slug} has no variant {name!r} (its variants: {have})")

    def build(self, verbose=False):
        """Compile (or load from cache) and return attn(q, k, v, causal=False, out=None): a
        flashlab.runtime.Attention."""
        from .runtime import build
        return build(self, verbose=verbose)

    def __str__(self):
        return f"{self.slug}: {self.title}"


# A scalar fp32 stage does no tensor-core work.
_SCALAR = {"HMMA": False}
# Stage 13's forward kernel: its name, template and machine-code evidence, which stages 19-21
# share (their .cu files include stage 13's whole: a Hopper backward saves the log-sum-exp with
# the fastest forward).
_HOPPER_FORWARD = dict(
    kernel="lazy_rescale_kernel",
    template=("T", "D", "BC", "STAGES", "CONSUMERS", "BLOCKS", "WITH_LSE"),
    sass={"HGMMA": True, "HMMA": False, "UTMALDG": True, "UTMASTG": True, "STG": False,
          "STS": True, "SYNCS": True, "USETMAXREG": True, "LDL": False, "STL": False})

_STAGES = (
    Stage(1, "01_naive", "Naive (flash-attention-minimal)",
          "FlashAttention-1 loop order, one thread per query row, m and l in global memory",
          ("fp32",), (64, 128), any_head_dim=True, kernel="naive_kernel", min_cc=(7, 5),
          # one thread per query row: 4-byte loads, no cross-lane work
          sass={**_SCALAR, "LDG": True, "LDG.E.128": False, "SHFL": False}),
    Stage(2, "02_coalesced", "Coalesced loads",
          "2-D thread blocks: a warp owns a row, reads 32 consecutive floats, splits the row's work",
          ("fp32",), (64, 128), any_head_dim=True, kernel="coalesced_kernel", min_cc=(7, 5),
          idea_metrics=("global_load_sectors_per_request",),
          # a warp per row: still 4-byte loads (coalesced across lanes), row max/sum by shuffles
          sass={**_SCALAR, "LDG": True, "LDG.E.128": False, "SHFL": True}),
    Stage(3, "03_coarsened", "Thread coarsening",
          "query tiles outer, m/l/O in registers, each thread a 4x4 patch, padded shared memory",
          ("fp32",), (64, 128), any_head_dim=False, kernel="coarsened_kernel",
          template=("D", "BR", "BC"), min_cc=(7, 5),
          idea_metrics=("smem_load_bank_conflicts", "achieved_occupancy_pct"),
          # float4 tiles: 16-byte global and shared loads; 16-lane shuffles for the row max/sum
          sass={**_SCALAR, "LDG.E.128": True, "LDS.128": True, "SHFL": True}),
    Stage(4, "04_wmma", "WMMA tensor cores",
          "QKᵀ and PV on tensor cores as 16x16x16 WMMA fragments, fp32 accumulate; S, P, O via "
          "shared memory",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True, kernel="wmma_kernel",
          template=("D", "BR", "BC", "T"), idea_metrics=("tensor_pipe_pct",),
          # fp16 WMMA exists since 7.0, bf16 since 8.0: on a T4 the sm_75 build has no bf16 kernel
          min_cc=(7, 5), dtype_min_cc={"bf16": (8, 0)},
          # HMMA in every instantiation; global loads all 16 bytes. LDSM is not asserted: nvcc
          # emits ldmatrix for fp16 fragments but not for bf16.
          sass={"HMMA": True, "LDG.E.128": True, "LDG": False, "SHFL": True}),
    Stage(5, "05_mma", "mma.sync + ldmatrix (FlashAttention-2 split)",
          "PTX mma.sync with published fragment layouts: Q, S, P and O live in registers, "
          "softmax by quad shuffles, ldmatrix(.trans) for K and V",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True, row_strides=True,
          kernel="mma_kernel", lse=True,
          template=("T", "D", "BR", "BC", "WITH_LSE"),
          # S and P stay in registers: shared-memory traffic falls, the tensor pipe gets busier
          idea_metrics=("smem_wavefronts", "tensor_pipe_pct"),
          sass={"HMMA": True, "LDSM": True, "LDG.E.128": True, "SHFL": True}),
    Stage(6, "06_swizzle", "Swizzled shared memory",
          "dense tiles with the 16-byte chunks of row r XOR-permuted by r % 8: conflict-free "
          "ldmatrix without padding",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True, row_strides=True,
          kernel="swizzle_kernel", lse=True,
          template=("T", "D", "BR", "BC", "WITH_LSE"),
          # same instructions, permuted addresses: no conflicts, and no padding
          idea_metrics=("smem_load_bank_conflicts", "smem_store_bank_conflicts"),
          sass={"HMMA": True, "LDSM": True, "LDG.E.128": True, "SHFL": True}),
    Stage(7, "07_cp_async", "cp.async pipeline",
          "K/V tiles copied global -> shared with cp.async into 2 buffers: the next tile loads "
          "while this one is computed",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True, row_strides=True,
          kernel="cp_async_kernel", lse=True,
          template=("T", "D", "BR", "BC", "STAGES", "WITH_LSE"),
          # loads in flight during the math: warps stop waiting on memory and on each other
          idea_metrics=("stall_long_scoreboard", "stall_barrier", "stall_mio_throttle"),
          # global -> shared without registers (LDGSTS): no 16-byte loads into registers
          sass={"HMMA": True, "LDSM": True, "LDGSTS": True, "LDG.E.128": False}),
    Stage(8, "08_tuned", "Tuned",
          "tile shape, warps, rows per warp, pipeline depth and five small changes picked per head "
          "dim, mask and range of N by an autotune on the GPU",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True, row_strides=True,
          kernel="tuned_kernel", lse=True,
          template=("T", "D", "BC", "WARPS", "WM", "STAGES", "Q_REGS", "OPTS", "WITH_LSE"),
          picks=True,
          # two row tiles per warp halve the shared-memory traffic per FLOP; the tensor pipe fills
          idea_metrics=("smem_wavefronts", "tensor_pipe_pct"),
          sass={"HMMA": True, "LDSM": True, "LDGSTS": True, "LDG.E.128": False}),
    Stage(9, "09_wgmma", "wgmma",
          "warpgroup wgmma.mma_async (64 rows x N x 16 per instruction, asynchronous): S = QKᵀ "
          "from shared memory through matrix descriptors, O += PV with P from registers, tiles in "
          "the 128-byte swizzle the descriptors name",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True, row_strides=True,
          kernel="wgmma_kernel", lse=True,
          template=("T", "D", "BC", "WGS", "STAGES", "BLOCKS", "RETIRE", "WITH_LSE"),
          min_cc=(9, 0), arch_specific=True,
          # bigger asynchronous tensor-core instructions: the tensor pipe busier, far fewer
          # instructions issued per FLOP
          idea_metrics=("tensor_pipe_pct", "sm_throughput_pct"),
          # wgmma reads its operands from shared memory itself: no ldmatrix, no mma.sync
          sass={"HGMMA": True, "HMMA": False, "LDSM": False, "LDGSTS": True}),
    Stage(10, "10_tma", "TMA + mbarrier",
          "K/V (and Q) tiles copied by the tensor memory accelerator from host-built tensor maps, "
          "one elected thread issuing, completion counted on an mbarrier ring; no block barrier "
          "in the loop",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True, row_strides=True,
          kernel="tma_kernel", lse=True,
          template=("T", "D", "BC", "WGS", "STAGES", "BLOCKS", "RETIRE", "WITH_LSE"),
          min_cc=(9, 0), arch_specific=True,
          # one instruction per box instead of 16-byte copies from every thread, and warpgroups
          # that wait on mbarriers instead of meeting at __syncthreads
          idea_metrics=("stall_barrier", "stall_long_scoreboard"),
          sass={"HGMMA": True, "HMMA": False, "UTMALDG": True, "SYNCS": True, "LDGSTS": False}),
    Stage(11, "11_warpspec", "Warp specialization",
          "a producer warpgroup only issues TMA copies and consumer warpgroups only compute, "
          "registers moved between them with setmaxnreg; a persistent grid claims work items "
          "from a counter",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True, row_strides=True,
          kernel="warpspec_kernel", lse=True,
          template=("T", "D", "BC", "STAGES", "CONSUMERS", "BLOCKS", "WITH_LSE"),
          min_cc=(9, 0), arch_specific=True,
          # the copies no longer stop a computing warp, and the consumers hold more registers:
          # less waiting on barriers, the tensor pipe busier
          idea_metrics=("stall_long_scoreboard", "tensor_pipe_pct"),
          sass={"HGMMA": True, "HMMA": False, "UTMALDG": True, "SYNCS": True, "USETMAXREG": True,
                "LDL": False, "STL": False}),
    Stage(12, "12_tma_store", "TMA store",
          "each consumer writes its finished O into its rows of the item's Q buffer, in the "
          "layout the TMA wrote Q in, and one thread copies it to global memory with a TMA store "
          "while the consumers go on to the next work item",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True, row_strides=True,
          kernel="tma_store_kernel", lse=True,
          template=("T", "D", "BC", "STAGES", "CONSUMERS", "BLOCKS", "WITH_LSE"),
          min_cc=(9, 0), arch_specific=True,
          # no more 4-byte stores from every thread (8 half-filled sectors each): the tensor pipe
          # waits less at the end of each work item
          idea_metrics=("global_store_sectors_per_request", "tensor_pipe_pct"),
          sass={"HGMMA": True, "HMMA": False, "UTMALDG": True, "UTMASTG": True, "STG": False,
                "STS": True, "SYNCS": True, "USETMAXREG": True, "LDL": False, "STL": False},
          # FlashAttention-3's two overlaps, which notebook 12 runs beside the stage: two
          # consumers, O stored from registers; without either overlap, then each added
          variants=(
              Variant(12, "no_overlap", "12_overlap.patch",
                      "D64:128,3,2,false,false;D128:128,2,2,false,false", "overlap_kernel",
                      "two consumers, O stored from registers, each tile's products then its "
                      "softmax: the kernel the overlaps are added to"),
              Variant(12, "in_warpgroup", "12_overlap.patch",
                      "D64:128,3,2,true,false;D128:128,2,2,true,false", "overlap_kernel",
                      "a consumer issues S_j with P_{j-1} V_{j-1} and runs tile j's softmax "
                      "while P_{j-1} V_{j-1} is in flight"),
              Variant(12, "ping_pong", "12_overlap.patch",
                      "D64:128,3,2,true,true;D128:128,2,2,true,true", "overlap_kernel",
                      "the in-warpgroup overlap, and the two consumers take turns at issuing "
                      "their products (named barriers), one's softmax under the other's products"),
          )),
    Stage(13, "13_lazy_rescale", "Lazy rescale",
          "after an item's first key tile, the exponentials are taken against the running "
          "maximum as it stands, without waiting for the tile's own; O is rescaled only when a "
          "row's maximum grows by more than 2^8, and that tile is then taken the classic way",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True, row_strides=True,
          **_HOPPER_FORWARD, lse=True, min_cc=(9, 0), arch_specific=True,
          # the exponentials no longer wait behind the shuffles of the row maximum, and a tile
          # has no rescale of O: less waiting on the short scoreboard, the tensor pipe busier
          idea_metrics=("stall_short_scoreboard", "tensor_pipe_pct")),
    Stage(14, "14_backward", "Backward pass (FlashAttention-2's Algorithm 2)",
          "the backward pass: the forward saves each row's log-sum-exp; a preprocessing pass "
          "takes Δ = rowsum(dO ∘ O); per key/value block P is recomputed from Q, K and the "
          "log-sum-exp, dV and dK are accumulated on chip and dQ is added up across blocks in fp32",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, row_strides=True,
          kernel="forward_kernel",
          template=("T", "D", "BC", "WARPS", "WM", "STAGES", "Q_REGS", "OPTS", "WITH_LSE"),
          picks=True,
          idea_metrics=("smem_wavefronts", "tensor_pipe_pct"),
          # the forward: stage 08's kernel, which now also stores the log-sum-exp
          sass={"HMMA": True, "LDSM": True, "LDGSTS": True, "LDG.E.128": False},
          lse=True, backward="bwd_kernel",
          # the backward's products on the CUDA cores (FFMA, no tensor cores), P recomputed
          # through exp2, dQ added up across key blocks by fp32 reductions to global memory
          backward_sass={"HMMA": False, "RED": True, "LDG.E.128": True},
          builds_on=8),
    Stage(15, "15_backward_mma", "Backward on tensor cores",
          "the backward's five products on tensor cores: mma.sync with ldmatrix operands from "
          "swizzled 16-bit tiles that cp.async double-buffers; P and dS go from accumulators to "
          "A fragments in registers, and dS reaches dQ through shared memory",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, row_strides=True,
          kernel="forward_kernel",
          template=("T", "D", "BC", "WARPS", "WM", "STAGES", "Q_REGS", "OPTS", "WITH_LSE"),
          picks=True,
          idea_metrics=("smem_wavefronts", "tensor_pipe_pct"),
          # the forward: stage 14's (stage 08's kernel with the log-sum-exp)
          sass={"HMMA": True, "LDSM": True, "LDGSTS": True, "LDG.E.128": False},
          lse=True, backward="bwd_kernel",
          # the backward's products on the tensor cores from ldmatrix operands, its tiles by
          # cp.async, dQ still added up across key blocks by fp32 reductions to global memory
          backward_sass={"HMMA": True, "LDSM": True, "LDGSTS": True, "RED": True,
                         "LDG.E.128": False},
          builds_on=14),
    Stage(16, "16_deterministic", "Deterministic backward",
          "dQ added in a fixed order: at each query block, the key blocks of a head take turns "
          "at its fp32 sum, each waiting on a counter for the one before it, so that the "
          "gradients are the same bits on every run",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, row_strides=True,
          kernel="forward_kernel",
          template=("T", "D", "BC", "WARPS", "WM", "STAGES", "Q_REGS", "OPTS", "WITH_LSE"),
          picks=True,
          idea_metrics=("smem_wavefronts", "tensor_pipe_pct"),
          # the forward: stage 14's (stage 08's kernel with the log-sum-exp)
          sass={"HMMA": True, "LDSM": True, "LDGSTS": True, "LDG.E.128": False},
          lse=True, backward="bwd_kernel", deterministic=True,
          # stage 15's backward, and the turns: fences (MEMBAR) and the counter's atomic
          # exchange (ATOM); on sm_90 the fenced dQ adds become ATOMs too (no RED left there)
          backward_sass={"HMMA": True, "LDSM": True, "LDGSTS": True, "MEMBAR": True,
                         "ATOM": True, "LDG.E.128": False},
          builds_on=15),
    Stage(17, "17_wide_warps", "Wide warps",
          "32 keys a warp: each Q and dO fragment a warp loads feeds twice the mma.sync of stage "
          "15 and a block holds 128 keys, half the dQ reductions; at D = 128 a pair of warps "
          "shares the 32 keys, dK and dV split by head-dim columns, P and dS through shared memory",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, row_strides=True,
          kernel="forward_kernel",
          template=("T", "D", "BC", "WARPS", "WM", "STAGES", "Q_REGS", "OPTS", "WITH_LSE"),
          picks=True,
          idea_metrics=("smem_wavefronts", "tensor_pipe_pct"),
          # the forward: stage 14's (stage 08's kernel with the log-sum-exp)
          sass={"HMMA": True, "LDSM": True, "LDGSTS": True, "LDG.E.128": False},
          lse=True, backward="bwd_kernel",
          # stage 15's instructions, more of them in flight: mma.sync from ldmatrix operands,
          # cp.async tiles, dQ by fp32 reductions to global memory
          backward_sass={"HMMA": True, "LDSM": True, "LDGSTS": True, "RED": True,
                         "LDG.E.128": False},
          builds_on=15),
    Stage(18, "18_dq_layout", "dQ laid out for its reductions",
          "dQ's fp32 sum kept in the order the warps add into it: tiles of 16 rows by 64 "
          "columns in which one warp-wide reduction covers contiguous bytes (two cache lines) "
          "instead of 8 rows of 32 bytes (eight lines); without the mask each key block starts "
          "at a different query block, so that a head's blocks add into different tiles",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, row_strides=True,
          kernel="forward_kernel",
          template=("T", "D", "BC", "WARPS", "WM", "STAGES", "Q_REGS", "OPTS", "WITH_LSE"),
          picks=True,
          # the reductions reach L2 as whole lines: fewer requests for the same sectors
          idea_metrics=("red_sectors_per_l2_request", "tensor_pipe_pct"),
          # the forward: stage 14's (stage 08's kernel with the log-sum-exp)
          sass={"HMMA": True, "LDSM": True, "LDGSTS": True, "LDG.E.128": False},
          lse=True, backward="bwd_kernel",
          # stage 17's instructions; the dQ reductions the same RED, to other addresses
          backward_sass={"HMMA": True, "LDSM": True, "LDGSTS": True, "RED": True,
                         "LDG.E.128": False},
          builds_on=17),
    Stage(19, "19_wgmma_backward", "wgmma backward",
          "the backward's five products on warpgroup wgmma: Sᵀ and dPᵀ with both operands from "
          "shared memory, dV and dK with Pᵀ and dSᵀ from registers, dQ from the dSᵀ tile and K "
          "both read transposed; two warpgroups of 64 keys a block",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, row_strides=True,
          **_HOPPER_FORWARD, min_cc=(9, 0), arch_specific=True, grad_strides=True,
          # bigger asynchronous instructions fed from shared memory: the tensor pipe busier, far
          # fewer instructions issued for the same products
          idea_metrics=("tensor_pipe_pct", "sm_throughput_pct"),
          lse=True, backward="bwd_kernel",
          # every product on wgmma: no mma.sync and no ldmatrix left in the backward
          backward_sass={"HGMMA": True, "HMMA": False, "LDSM": False, "LDGSTS": True, "RED": True},
          builds_on=18),
    Stage(20, "20_warpspec_backward", "Warp-specialized backward",
          "a producer warpgroup moves the backward's bytes: one thread brings K, V, Q, dO, the "
          "log-sum-exps and Δ with the TMA onto an mbarrier ring, another adds each query "
          "block's dQ into the fp32 sum with one bulk reduction from shared memory; the two "
          "consumer warpgroups, given its registers by setmaxnreg, only multiply",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, row_strides=True,
          **_HOPPER_FORWARD, min_cc=(9, 0), arch_specific=True, grad_strides=True,
          # the multiplying warps no longer wait on their own loads and reductions: the tensor
          # pipe busier, the barrier and memory stalls of stage 19 gone from them
          idea_metrics=("tensor_pipe_pct", "sm_throughput_pct"),
          lse=True, backward="bwd_kernel",
          # stage 19's products; the tiles by the TMA (tensor and 1-D bulk copies), dQ by bulk
          # reductions, registers moved by setmaxnreg; no cp.async and no per-lane reduction left
          backward_sass={"HGMMA": True, "UTMALDG": True, "UBLKCP": True, "UBLKRED": True,
                         "USETMAXREG": True, "LDGSTS": False, "RED": False, "HMMA": False},
          builds_on=19),
    Stage(21, "21_deterministic_hopper", "Deterministic warp-specialized backward",
          "dQ added in a fixed order on Hopper: before each bulk reduction the producer's dQ "
          "thread waits on a counter for its block's turn at the query block, and passes the turn "
          "on once its addition is complete in L2, so that the gradients are the same bits on "
          "every run while the consumers keep multiplying",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, row_strides=True,
          **_HOPPER_FORWARD, min_cc=(9, 0), arch_specific=True, grad_strides=True,
          # the turns reach the consumers only when both dQ buffers wait behind a turn: the
          # tensor pipe less busy by those waits, which the long scoreboard (mbarriers) counts
          idea_metrics=("tensor_pipe_pct", "stall_long_scoreboard"),
          lse=True, backward="bwd_kernel", deterministic=True,
          # stage 20's instructions, and the turns: the acquiring load that reads the counter
          # (the one LDG of a kernel that otherwise reads global memory through the TMA alone), a
          # GPU-wide fence before the releasing store (MEMBAR), the bulk reductions the same UBLKRED
          backward_sass={"HGMMA": True, "UTMALDG": True, "UBLKCP": True, "UBLKRED": True,
                         "USETMAXREG": True, "MEMBAR": True, "LDG": True, "LDGSTS": False,
                         "RED": False, "HMMA": False},
          builds_on=20),
    Stage(22, "22_overlap_backward", "Overlapped backward",
          "inside each consumer warpgroup, the arithmetic between the products runs under them: "
          "Sᵀ and dPᵀ are two wgmma groups and P is computed while dPᵀ is multiplied; dV's "
          "products are issued at once and dS is computed while they run (at D = 128, where "
          "the registers allow it)",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, row_strides=True,
          **_HOPPER_FORWARD, min_cc=(9, 0), arch_specific=True, grad_strides=True,
          # the tensor pipe kept busy while the exponentials run: busier, the SM too
          # waits on their own products (wgmma.wait_group) shorter
          idea_metrics=("tensor_pipe_pct", "sm_throughput_pct"),
          lse=True, backward="bwd_kernel",
          # stage 20's instructions; what differs is where the warpgroups wait for their groups
          backward_sass={"HGMMA": True, "UTMALDG": True, "UBLKCP": True, "UBLKRED": True,
                         "USETMAXREG": True, "LDGSTS": False, "RED": False, "HMMA": False},
          overlapped_waits={64: 2, 128: 3},
          builds_on=20),
    Stage(23, "23_tma_store_backward", "dK and dV written by the TMA",
          "a backward block ends as stage 12's forward does: its dK and dV go through shared "
          "memory (the ring of Q and dO, free once the last products are done) and the TMA "
          "writes them, in place of 4-byte stores from every thread's registers",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, row_strides=True,
          **_HOPPER_FORWARD, min_cc=(9, 0), arch_specific=True, grad_strides=True,
          # no 4-byte stores from every thread (8 half-filled sectors each): the warps no longer
          # wait at the block's end for their stores to drain
          idea_metrics=("global_store_sectors_per_request", "stall_drain"),
          lse=True, backward="bwd_kernel",
          # stage 22's instructions, and the TMA's store in place of every STG
          backward_sass={"HGMMA": True, "UTMALDG": True, "UTMASTG": True, "UBLKCP": True,
                         "UBLKRED": True, "USETMAXREG": True, "STG": False, "LDGSTS": False,
                         "RED": False, "HMMA": False},
          overlapped_waits={64: 2, 128: 3},
          builds_on=22),
)


def stages():
    """All stages, in order."""
    return list(_STAGES)


def fastest_forward() -> Stage:
    """The last stage timed over the FlashAttention sweep (registry: fast): the forward pass the
    README's sweep table and the figures set against SDPA's."""
    return [st for st in _STAGES if st.fast][-1]


def last_backward() -> Stage:
    """The last stage with a backward pass (and the log-sum-exp it needs) that is not a
    deterministic variant (those trade speed for the same bits on every run, and are chosen by
    name): what a model trains through, and ring attention's default local attention."""
    return [st for st in _STAGES if st.lse and st.has_backward and not st.deterministic][-1]


def introduced_through(key) -> set:
    """The machine-code categories the workbook has met by stage `key`: those some stage up to it
    names as present in its kernels, and the shared ones every stage asserts (no spills, ...)."""
    last = stage(key).number
    found = set(COMMON_SASS)
    for st in _STAGES:
        if st.number <= last:
            found |= {c for c, present in st.sass.items() if present}
    return found


def before(key):
    """The stage a stage improves on, and its notebook diffs and measures against: its builds_on,
    or else the one before it in order (None for the first)."""
    st = stage(key)
    if st.builds_on is not None:
        return stage(st.builds_on)
    i = _STAGES.index(st)
    return _STAGES[i - 1] if i > 0 else None


def backward_ladder(key) -> list:
    """The stage and every earlier stage with a backward pass, latest first (18: 18, 17, 16, 15, 14;
    [] for a stage without one): what its notebook's evaluate_backward times in one run. The
    results table keeps a key's latest row, so a later backward notebook run live re-times every
    earlier backward beside the same SDPA rows, and each earlier notebook still finds its
    comparisons (its stage, the one it builds on, SDPA's) within one run."""
    st = stage(key)
    if not st.has_backward:
        return []
    return [s for s in reversed(_STAGES) if s.has_backward and s.number <= st.number]


def stage(key) -> Stage:
    """A stage by number (3), number string ('03', '3') or slug ('03_coarsened'); a Stage
    passes through."""
    if isinstance(key, Stage):
        return key
    for st in _STAGES:
        if key == st.number or key == st.slug or (isinstance(key, str) and key.isdigit()
                                                  and int(key) == st.number):
            return st
    known = ", ".join(st.slug for st in _STAGES)
    shown = key if isinstance(key, int) or (isinstance(key, str) and key.isdigit()) else repr(key)
    raise ValueError(f"no stage {shown}; the stages are {known}")
