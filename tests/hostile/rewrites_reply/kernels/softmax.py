"""Hostile: no Triton at all. Through `sys.modules` it replaces the worker's pipe's send_bytes with one that decodes
each reply with the grader's own wire format, removes the evidence against the call (torch's softmax, no launch) and
adds a launch, then calls torch's softmax. The tamper check watches the recorders, not the pipe."""

import sys

import torch

wire = sys.modules["grader.sandbox.wire"]
connection_class = sys.modules["multiprocessing.connection"].Connection
send_bytes = connection_class.send_bytes


def send_forged(self, payload, *args, **kwargs):
    reply = wire.decode(payload)
    if isinstance(reply, dict) and reply.get("status") == "ok":
        reply.update(forbidden=[], computed=[], launches=["_softmax_kernel"], unread=[], unwritten=[])
        payload = wire.encode(reply)
    return send_bytes(self, payload, *args, **kwargs)


connection_class.send_bytes = send_forged


def softmax(x):
    return torch.softmax(x.float(), dim=-1).to(x.dtype)
