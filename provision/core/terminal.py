"""Text from a node, a bucket or a vendor, made safe to print on a terminal: the one sanitizer.

A node writes job.log, events.jsonl, metrics.jsonl, status.json and summary.json, and a vendor
writes its status messages. Printed as they are, their escape sequences would act on the user's
terminal: clear the screen, set the window title, write the clipboard (OSC 52), hide a line
(carriage return, cursor moves). `scrub` removes every ECMA-48 control sequence (CSI, OSC, DCS,
SOS, PM, APC, in their 7-bit ESC and 8-bit C1 forms, up to their terminator), then every control
character left (C0 but tab, DEL, C1) and the Unicode bidi controls that reorder what is shown.
The text around them stays as it was. `gpuctl logs --raw` is the one way around it.
"""

from __future__ import annotations

import re

# CSI: ESC [ (or 0x9B), parameter bytes, intermediate bytes, a final byte.
_CSI = r"(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"
# Control strings (OSC ESC ], DCS ESC P, SOS ESC X, PM ESC ^, APC ESC _, or their C1 bytes) run to
# their terminator: ST (ESC \ or 0x9C) or BEL; one left open ends at the line's end or the next ESC.
_STRING = r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c\n]*(?:\x07|\x1b\\|\x9c)?"
# Any other escape: ESC, intermediate bytes, one final byte (ESC c resets the terminal).
_ESCAPE = r"\x1b[\x20-\x2f]*[\x30-\x7e]?"
_SEQUENCE = re.compile(f"{_CSI}|{_STRING}|{_ESCAPE}")
_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}]")
_CONTROL_NO_NEWLINE = re.compile(f"[\x00-\x08\x0a-\x1f\x7f-\x9f{_BIDI}]")


def scrub(text: str, *, newlines: bool = False) -> str:
    """`text` without escape sequences and control characters (tab kept; newline kept with
    `newlines`, else it becomes a space: one field of a record stays one line)."""
    if text.isprintable():  # the common case: nothing to do (isprintable is False for \t and \n too)
        return text
    text = _SEQUENCE.sub("", text)
    if newlines:
        return _CONTROL.sub("", text)
    return _CONTROL_NO_NEWLINE.sub("", text.replace("\n", " "))
