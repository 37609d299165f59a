# %% [markdown]
# # Stage 21 — Deterministic warp-specialized backward
#
# Stage 20 (warp-specialized backward) (write: where its time goes). This stage changes one thing:
# dQ added in a fixed order on Hopper: before each bulk reduction the producer's dQ thread waits on a counter for its turn at the query block, and passes the turn on once its addition is complete in L2, so that the gradients are the same bits on every run while the consumers keep multiplying.
#
# ## Objectives
# After this notebook you can:
# - (write: what a student can do with this stage's idea);
# - (write: what they can predict with it);
# - (write: what they can read off its profile).
#
# **Prerequisites:** notebook 20.
#
# **Time:** about 2 min to read, 20 min to work through.

# %%
# %matplotlib inline
import flashlab as fl
from flashlab import notebook as nb
nb.banner("21_deterministic_hopper")

# %%
print(nb.the_gpu())  # this GPU, or the one the recorded numbers come from

# %% [markdown]
# ## 1 · The idea
#
# (write: the idea, with a figure drawn by this stage's lesson module).

# %% [markdown]
# ## 2 · What changed
#
# The whole change against stage 20:

# %%
nb.show_diff("20_warpspec_backward", "21_deterministic_hopper", context=1)

# %% [markdown]
# ## 3 · Prediction
#
# (write: a number, from a model of what the change moves).

# %%
with nb.unless_missing():
    print(nb.evaluate("21_deterministic_hopper"))

# %%
with nb.unless_missing():
    print(f"{nb.speedup('20_warpspec_backward', '21_deterministic_hopper', 'fp16'):.2f}x stage 20")

# %% [markdown]
# ### Discussion
#
# (write: the prediction against the measurement, and why they differ).

# %% [markdown]
# ## 4 · The profile

# %%
with nb.unless_missing():
    print(nb.profile("21_deterministic_hopper"))

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
nb.reached("21_deterministic_hopper")
