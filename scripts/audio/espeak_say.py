"""Speak one sentence with the eSpeak NG library that the espeakng-loader wheel bundles (with its
voice data): no system package. Writes the sample rate (4 bytes, little-endian) then the int16
samples to stdout.

    python espeak_say.py TEXT

One sentence per process, as the espeak-ng command does: eSpeak's voicing noise carries state from
one utterance to the next within a process, so only a fresh process gives the same samples every
time (the same as `espeak-ng -w` of the same version). Needs ctypes only, so it starts fast.
"""
from __future__ import annotations

import ctypes
import sys

import espeakng_loader

AUDIO_OUTPUT_SYNCHRONOUS = 2  # espeak_AUDIO_OUTPUT: samples go to the callback, espeak_Synth returns when done
POS_CHARACTER = 1
CHARS_AUTO, ENDPAUSE = 0, 0x1000  # what the espeak-ng command passes (less its [[phoneme]] input)
VOICE = b"en"  # the espeak-ng command's default voice
CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


def say(text: str) -> tuple[int, bytes]:
    """(sample rate, int16 samples) of `text` in eSpeak NG's default English voice."""
    lib = ctypes.CDLL(espeakng_loader.get_library_path())
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                 ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
    data_path = espeakng_loader.get_data_path()
    rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path.encode(), 0)
    if rate <= 0:
        raise RuntimeError(f"espeak_Initialize failed ({rate}) with its data at {data_path}")
    if lib.espeak_SetVoiceByName(VOICE) != 0:
        raise RuntimeError(f"eSpeak NG has no voice {VOICE.decode()!r}")
    chunks = []

    def collect(wav, count, events) -> int:
        if wav and count > 0:
            chunks.append(ctypes.string_at(wav, count * ctypes.sizeof(ctypes.c_short)))
        return 0  # go on

    callback = CALLBACK(collect)  # referenced until the synthesis returns
    lib.espeak_SetSynthCallback(callback)
    encoded = text.encode()
    status = lib.espeak_Synth(encoded, len(encoded) + 1, 0, POS_CHARACTER, 0, CHARS_AUTO | ENDPAUSE, None, None)
    if status != 0:
        raise RuntimeError(f"espeak_Synth failed ({status}) on {text!r}")
    return rate, b"".join(chunks)


if __name__ == "__main__":
    rate, samples = say(sys.argv[1])
    sys.stdout.buffer.write(rate.to_bytes(4, "little") + samples)
