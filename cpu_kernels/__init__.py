"""Hand-written CPU kernels (C with AVX-512 intrinsics), built with the machine's C compiler on first use.

`matvec`: the few-row products of CPU decode, streaming each weight at memory speed. `decode_attention`: paged
decode attention reading the KV pages in place. `library`: builds all `*.c` here into one cached library and
loads it. Only `astrai.ops` calls these; every op falls back to plain torch where a kernel cannot be built or run.
"""
