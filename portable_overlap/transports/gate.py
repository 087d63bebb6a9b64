"""Counter-gated streams: a stream ordered behind the tiles that a running kernel finishes,
with no CPU polling. A producing kernel counts the finished tiles of a group in a 32-bit word;
a stream waits (the backend's stream wait-value, in whatever form the backend picks for the
stream now: a wait in the GPU's front end that takes no SM, or a small spinning kernel, which
``DeviceFacts.gate_programs`` counts) until the word reaches the group's size, and what is
queued on it after the wait (a collective of the vendor's library, copy-engine copies) starts as
soon as the group is done.

The waiter resets the word to 0 on its own stream right after the wait: the next call's kernel
counts from 0 without a host write between calls, and a CUDA graph replays the same sequence.

The words come from ``backend.alloc_gate_words`` (``backends.GateWords``): contiguous, or each its
own allocation where the backend's zero-SM wait needs that (ROCm's signal memory); a producing
kernel finds word g with :func:`gate_word` either way, and the host with ``words.address(g)``."""
import triton
import triton.language as tl


@triton.jit
def gate_word(words_ptr, g, INDIRECT: tl.constexpr):
    """Pointer to gate word ``g``: ``words_ptr`` is ``GateWords.kernel_arg`` and ``INDIRECT``
    its ``indirect``: the int32 words themselves, or the int64 table of their addresses (one
    load more per count, only where the words are separate allocations)."""
    if INDIRECT:
        word = tl.load(words_ptr + g).to(tl.pointer_type(tl.int32))
    else:
        word = words_ptr + g
    return word


def wait_counter(backend, stream, counter_addr: int, target: int) -> None:
    """Hold ``stream`` (a backend stream handle) until the uint32 at ``counter_addr``
    (``GateWords.address`` of a word of ``backend.alloc_gate_words``) is ``>= target``, then
    set it to 0 on the same stream."""
    backend.stream_wait_value(stream, counter_addr, target)
    backend.stream_write_value(stream, counter_addr, 0)
