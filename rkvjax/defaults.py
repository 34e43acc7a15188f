"""Every default of the built-in cache settings, defined here once (no imports: the kernels,
the scores, the policies, the configs and the command line all read them). A plug-in method
defines its own in its dataclass."""

# The cache (every compressing method).
WINDOW = 8  # W: the newest tokens, always kept; their queries score the others
BUFFER = 128  # decoded tokens appended between compressions
ANSWER_SLOTS = 512  # think-only mode: slots for the answer once a row stops thinking
SHARE = "none"  # a kept set per (layer, KV head); "heads", "layers" or "all" share one per row

# The built-in methods' hyperparameters (RKV_SPEC.md).
KERNEL = 7  # importance max-pool width (R-KV, SnapKV)
LAM = 0.1  # R-KV: score = lam * importance - (1 - lam) * redundancy
THRESHOLD = 0.5  # R-KV: cosine above which two keys are redundant
RETAIN = 1  # R-KV: a key's newest redundant copies that are not counted (the reference: 1)
SINKS = 4  # StreamingLLM: attention sinks kept at the start
