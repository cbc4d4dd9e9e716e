"""Work-arounds for paramiko, on the one transport a host's commands share.

Every remote command is a channel on its host's one transport (:mod:`.connections`), so a
paramiko race that drops a connection drops every command of that host. Here: data and EOF
sent in order with the transport thread's handling of a channel's close (:func:`ordered_send`),
sshd's answer to an exec request settled where paramiko reads it (:func:`hook_exec_answers`),
and an open transport's steady state (:func:`settle`).
"""

from __future__ import annotations

import socket
import time

KEEPALIVE_S = 5
# paramiko's transport thread reads its socket with a 0.1 s timeout, only to look at its own
# flags (closed? keepalive due?) between reads: ten wakeups a second per idle host, 0.40 ms
# of CPU per host-second measured here (41% of a core for 1,024 idle hosts, under the GIL the
# event loop needs). After the handshake, 1 s: 0.10 ms. Data wakes the thread at once either
# way; only the flag checks wait longer, and nothing waits on them (closes drop the socket).
TRANSPORT_POLL_S = 1.0
REKEY_WAIT_S = 15  # paramiko's own limit for the same wait is 30 s


def ordered_send(chan, build):
    """Send the message ``build()`` makes on ``chan`` while holding the channel's lock, so
    that paramiko's transport thread cannot answer the server's CLOSE in between.

    Why: paramiko makes a data or EOF message under the channel lock but sends it after
    releasing the lock (Channel._send, Channel.shutdown). When the command ends at that
    moment, the transport thread takes the lock, answers sshd's CLOSE with its own CLOSE,
    and sshd frees the channel; our message then refers to a channel that no longer exists,
    and OpenSSH drops the whole connection ("ieof packet referred to nonexistent channel",
    paramiko issues #1115 and #1705, open). With one transport per host reused for
    everything, that cut every other channel of the host: a node channel's ping or a short
    command's EOF could take down the log tail and the teardown's own channel. Measured on
    the test hosts: two or three short commands at a time on one transport lost it within
    30-130 rounds.

    ``build`` runs under the lock and returns (message, bytes of data it carries), or None
    when there is nothing to send (the channel is closed, EOF already sent). A rekey in
    progress is waited out before the lock is taken: the transport thread may need the lock
    to finish it. Returns what ``build`` returned once its message is sent; None when the
    channel or the transport is gone; socket.timeout when a rekey does not end within
    REKEY_WAIT_S."""
    transport = chan.transport
    deadline = time.monotonic() + REKEY_WAIT_S
    while True:
        if transport is None or not transport.is_active():
            return None
        if not transport.clear_to_send.wait(0.5):
            if time.monotonic() > deadline:  # a rekey that never ends: a dead peer mid-exchange
                raise socket.timeout(f"the connection's key exchange did not finish within {REKEY_WAIT_S}s")
            continue
        with chan.lock:
            if not transport.clear_to_send.is_set():  # a rekey began meanwhile
                continue
            made = build()
            if made is None:
                return None
            # The check and the send under the transport's clear_to_send_lock (what paramiko's
            # _send_user_message does), without its wait: a rekey that began while build()
            # waited for the peer's window (long, on a slow link) must not be waited out here,
            # holding chan.lock: the transport thread needs that lock to hand the channel the
            # data the peer sends meanwhile, so the key exchange it is running cannot end. It
            # deadlocked a staging stream at 512 MiB, paramiko's rekey threshold, whenever the
            # command was printing while it read (ftbundle/stage.py, capped links).
            with transport.clear_to_send_lock:
                if transport.clear_to_send.is_set():
                    transport._send_message(made[0])
                    return made
            _give_back(chan, made)  # (then wait for the rekey's end outside the lock, and build anew)


def _give_back(chan, made) -> None:
    """Undo what ``build`` reserved (call under chan.lock): the window its data took, or EOF's mark."""
    if made[1]:
        chan.out_window_size += made[1]
    else:
        chan.eof_sent = False


def data_message(chan, data: bytes):
    """(message, bytes of ``data`` it carries: its start), or None: call under the lock."""
    from paramiko.common import cMSG_CHANNEL_DATA
    from paramiko.message import Message

    if chan.closed:
        return None
    size = chan._wait_for_send_window(len(data))
    if size == 0:
        return None
    message = Message()
    message.add_byte(cMSG_CHANNEL_DATA)
    message.add_int(chan.remote_chanid)
    message.add_string(data[:size])
    return message, size


def eof_message(chan):
    """(the EOF message, 0), or None once EOF was sent or the channel closed: call under the
    lock."""
    if chan.closed:
        return None
    message = chan._send_eof()  # (paramiko's name: it makes the message and marks EOF as sent)
    return None if message is None else (message, 0)


def hook_exec_answers(transport) -> None:
    """Once per transport: sshd's success answer to a channel request goes through the
    channel's ``ftb_on_answer`` first, on paramiko's transport thread where it is read (one
    level under exec_command, which only waits for it). The hook says whether the answer still
    counts: False when the start's time limit closed the channel first."""
    if transport.__dict__.get("_ftb_answers_hooked"):
        return
    from paramiko.channel import Channel
    from paramiko.common import MSG_CHANNEL_SUCCESS

    def success(chan, m) -> None:
        hook = chan.__dict__.pop("ftb_on_answer", None)
        if hook is None or hook():
            Channel._request_success(chan, m)

    transport._channel_handler_table = {**type(transport)._channel_handler_table, MSG_CHANNEL_SUCCESS: success}
    transport._ftb_answers_hooked = True


def settle(transport) -> None:
    """An open transport's steady state: keepalives, and a socket its thread polls once a
    second, not ten times (TRANSPORT_POLL_S)."""
    transport.set_keepalive(KEEPALIVE_S)
    transport.sock.settimeout(TRANSPORT_POLL_S)
