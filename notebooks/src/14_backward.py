# %% [markdown]
# # Stage 14 — Backward pass (FlashAttention-2's Algorithm 2)
#
# Stage 08 (tuned) (write: where its time goes). This stage changes one thing:
# the backward pass: the forward saves each row's log-sum-exp; a preprocessing pass takes Δ = rowsum(dO ∘ O); per key/value block P is recomputed from Q, K and the log-sum-exp, dV and dK are accumulated on chip and dQ is added up across blocks in fp32.
#
# ## Objectives
# After this notebook you can:
# - (write: what a student can do with this stage's idea);
# - (write: what they can predict with it);
# - (write: what they can read off its profile).
#
# **Prerequisites:** notebook 08.
#
# **Time:** about 2 min to read, 20 min to work through.

# %%
# %matplotlib inline
import flashlab as fl
from flashlab import notebook as nb
nb.banner("14_backward")

# %%
print(nb.the_gpu())  # this GPU, or the one the recorded numbers come from

# %% [markdown]
# ## 1 · The idea
#
# (write: the idea, with a figure drawn by this stage's lesson module).

# %% [markdown]
# ## 2 · What changed
#
# The whole change against stage 08:

# %%
nb.show_diff("08_tuned", "14_backward", context=1)

# %% [markdown]
# ## 3 · Prediction
#
# (write: a number, from a model of what the change moves).

# %%
with nb.unless_missing():
    print(nb.evaluate("14_backward"))

# %%
with nb.unless_missing():
    print(f"{nb.speedup('08_tuned', '14_backward', 'fp16'):.2f}x stage 08")

# %% [markdown]
# ### Discussion
#
# (write: the prediction against the measurement, and why they differ).

# %% [markdown]
# ## 4 · The profile

# %%
with nb.unless_missing():
    print(nb.profile("14_backward"))

# %% [markdown]
# ### Discussion
#
# (write: what the profile proves of the idea).

# %% [markdown]
# ## Questions for discussion
#
# 1. (write).
# 2. (write).

# %% [markdown]
# ## Summary
#
# - (write).

# %%
nb.reached("14_backward")
