"""How a finished piece of output travels to the rank that needs it, when it is not stored there
by the computing kernel itself (the zero-copy stores live in the op kernels):

- ``copy_engine``: DMA copies into a peer's heap, ordered on a side stream behind the producing
  work, with flags written and waited by one-program kernels (bounded waits, no host polling);
- ``gate``: a stream held until a kernel's per-group tile counter is full (a front-end stream
  wait), so a collective or copy queued behind it starts when its tiles are done.
"""
