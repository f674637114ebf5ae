"""Tensor-only wire format for declared payloads.

An algorithm declares each payload as an ordered tuple of ``Field`` (name, dtype, trailing
shape); only the leading dimension (rows, e.g. "the classes this client holds") varies.
A message carries one entry per logical client (or one entry for a broadcast) and is
encoded as two tensors:

* ``header`` (int64): ``[num_entries, (entry_id, rows_field_0, ..., rows_field_F-1) * num_entries]``
* ``body`` (uint8): the raw bytes of every field of every entry, in declared order.

No names, dtypes or Python objects travel: both sides know the spec, so decoding is a
matter of slicing. This keeps pickle out of the round loop and makes the byte count of a
round exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from htfl_dist.errors import ProtocolError
from htfl_dist.payload import Field, Payload, PayloadSpec

__all__ = ["BROADCAST_ENTRY", "Encoded", "Field", "Payload", "PayloadDeclarationError", "PayloadSpec",
           "decode", "encode", "message_bytes", "pass_within_process"]

BROADCAST_ENTRY = -1
"""Entry id used for server → clients messages (they address every client)."""




@dataclass
class Encoded:
    header: torch.Tensor
    body: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.header.numel() * 8 + self.body.numel()


class PayloadDeclarationError(TypeError):
    """An algorithm built a payload that does not match its own declaration: a bug in the code
    that sends it, not bad input, so it keeps its traceback (a ProtocolError would be reported
    as a one-line user error)."""


def _check_field(field: Field, tensor: torch.Tensor, entry_id: int) -> None:
    if tensor.dtype != field.dtype:
        raise PayloadDeclarationError(
            f"payload field '{field.name}' of client {entry_id} has dtype {tensor.dtype}, "
            f"declared {field.dtype}"
        )
    if tuple(tensor.shape[1:]) != field.trailing_shape:
        raise PayloadDeclarationError(
            f"payload field '{field.name}' of client {entry_id} has shape {tuple(tensor.shape)}, "
            f"declared (rows, {', '.join(map(str, field.trailing_shape))})"
        )


def _check_declared(spec: PayloadSpec, payload: Payload, entry_id: int) -> None:
    """``payload`` holds exactly the declared fields, each of its declared dtype and trailing shape."""
    missing = [f.name for f in spec if f.name not in payload]
    extra = sorted(set(payload) - {f.name for f in spec})
    if missing or extra:
        raise PayloadDeclarationError(
            f"payload of client {entry_id} does not match its declaration "
            f"(missing {missing}, undeclared {extra})"
        )
    for field in spec:
        _check_field(field, payload[field.name], entry_id)


def encode(spec: PayloadSpec, entries: dict[int, Payload]) -> Encoded:
    """Encode ``{entry_id: payload}`` (entries ordered by id) into header + body tensors."""
    header: list[int] = [len(entries)]
    chunks: list[torch.Tensor] = []
    for entry_id in sorted(entries):
        payload = entries[entry_id]
        _check_declared(spec, payload, entry_id)
        header.append(entry_id)
        for field in spec:
            tensor = payload[field.name]
            header.append(tensor.shape[0])
            chunks.append(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8))
    body = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return Encoded(torch.tensor(header, dtype=torch.int64), body)


def message_bytes(spec: PayloadSpec, entries: dict[int, Payload]) -> int:
    """What :func:`encode` of ``entries`` would count (``Encoded.nbytes``), without encoding."""
    header_values = 1 + len(entries) * (1 + len(spec))
    return header_values * 8 + sum(payload[field.name].numel() * field.dtype.itemsize
                                   for payload in entries.values() for field in spec)


def pass_within_process(spec: PayloadSpec, entries: dict[int, Payload], device: torch.device | str = "cpu",
                        owned: bool = False) -> tuple[dict[int, Payload], int]:
    """``decode(spec, encode(spec, entries), device)`` and the message's byte count, for a message
    that never leaves the process (world size 1): the same declaration checks and fresh tensors,
    so a receiver never aliases a sender's state, with one copy per tensor instead of packing
    every upload into a byte buffer and slicing it out again (0.36 s a round for 50 pfl CNNs).
    ``owned``: the sender holds no other reference to these tensors (the train phase copies any
    upload tensor that shares storage with its client's state, ``local_training.owned_upload``),
    so they are handed over, copied only to reach ``device`` or to be contiguous: the copy of 50
    pfl CNN rows cost 0.1 s a round."""
    passed: dict[int, Payload] = {}
    for entry_id in sorted(entries):
        payload = entries[entry_id]
        _check_declared(spec, payload, entry_id)
        passed[entry_id] = {field.name: payload[field.name].detach().to(device, copy=not owned).contiguous()
                            for field in spec}
    return passed, message_bytes(spec, entries)


def decode(spec: PayloadSpec, message: Encoded, device: torch.device | str = "cpu") -> dict[int, Payload]:
    """Inverse of :func:`encode`; validates sizes so a corrupt message fails loudly."""
    header = message.header.tolist()
    body = message.body.to("cpu")
    if not header:
        raise ProtocolError("empty message header")
    count, cursor, offset = header[0], 1, 0
    expected_len = 1 + count * (1 + len(spec))
    if count < 0 or len(header) != expected_len:
        raise ProtocolError(f"message header has {len(header)} values, expected {expected_len}")
    entries: dict[int, Payload] = {}
    for _ in range(count):
        entry_id = header[cursor]
        cursor += 1
        if entry_id in entries:  # a repeat would silently replace the first
            raise ProtocolError(f"message holds client {entry_id} twice")
        payload: Payload = {}
        for field in spec:
            rows = header[cursor]
            cursor += 1
            size = rows * field.row_bytes()
            if rows < 0 or offset + size > body.numel():
                raise ProtocolError(f"message body too short for field '{field.name}' of client {entry_id}")
            shape = (rows, *field.trailing_shape)
            if size == 0:
                payload[field.name] = torch.empty(shape, dtype=field.dtype, device=device)
                continue
            # clone: a fresh contiguous buffer is aligned for any dtype view
            raw = body[offset : offset + size].clone()
            offset += size
            payload[field.name] = raw.view(field.dtype).reshape(shape).to(device)
        entries[entry_id] = payload
    if offset != body.numel():
        raise ProtocolError(f"message body has {body.numel() - offset} unexpected trailing bytes")
    return entries
