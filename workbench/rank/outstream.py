"""The engines' stdout and stderr: ipykernel's ``OutStream``, without the flushes that have nothing to send.

ipykernel flushes both streams around every request an engine serves (four flushes an ``apply``), and each
flush is a round trip to the engine's IOPub thread that the main thread waits for. A rank's calls mostly print
nothing, so on every step of a session those round trips carried nothing and cost the engine's main thread a
thread hand-off each way. A flush here goes to the IOPub thread only when something was written since the last
one: what a rank prints still reaches the client before the call's reply, as before.
"""

from __future__ import annotations

from ipykernel.iostream import OutStream


class QuietFlushStream(OutStream):
    def flush(self) -> None:
        if self._nothing_pending():
            return
        super().flush()

    def _nothing_pending(self) -> bool:
        """Nothing written since the last flush reached the IOPub thread. A write fills the buffer under the lock
        before it asks for a flush; a flush in progress on that thread has cleared the flags and taken the buffer
        (so the order on IOPub, where the call's idle status follows, is kept: that thread sends in order)."""
        if self._flush_pending or self._subprocess_flush_pending or not self._is_master_process():
            return False
        with self._buffer_lock:
            return not self._buffers
