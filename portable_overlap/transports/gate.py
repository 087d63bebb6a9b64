"""Counter-gated streams: a stream ordered behind the tiles that a running kernel finishes,
with no CPU polling. A producing kernel counts the finished tiles of a group in a 32-bit word;
a stream waits (the backend's stream wait-value, in whatever form the backend picks for the
stream now: a wait in the GPU's front end that takes no SM, or a small spinning kernel, which
``DeviceFacts.gate_programs`` counts) until the word reaches the group's size, and what is queued on it after the wait (a collective of the vendor's
library, copy-engine copies) starts as soon as the group is done.

The waiter resets the word to 0 on its own stream right after the wait: the next call's kernel
counts from 0 without a host write between calls, and a CUDA graph replays the same sequence."""


def wait_counter(backend, stream, counter_addr: int, target: int) -> None:
    """Hold ``stream`` (a backend stream handle) until the uint32 at ``counter_addr`` (a word of
    ``backend.alloc_gate_words``) is ``>= target``, then set it to 0 on the same stream."""
    backend.stream_wait_value(stream, counter_addr, target)
    backend.stream_write_value(stream, counter_addr, 0)
