// arrayattn/attention/cuda/elem16.cuh -- the element types of the kernels that take their dtype as
// a template tag (attn_bwd.cu, decode_attn.cu): float and double are themselves; float16
// and bfloat16 are the tags AaF16 / AaBF16 whose storage is unsigned short (no cuda_fp16.h:
// NVRTC needs no include path), converted with cvt. AaIO<T>::type is the storage type,
// to_f / from_f convert to and from the accumulation type (float for the 16-bit tags).
//
// Under a host emulator (AA_HOST_EMULATION, tests/kernels/backward_emulator.h) the
// emulator declares the tags and supplies the four conversions.
#pragma once

#ifndef AA_HOST_EMULATION
#define AA_ELEM_DEV __device__ __forceinline__

struct AaF16 {};   // float16
struct AaBF16 {};  // bfloat16

AA_ELEM_DEV float aa_f16_to_f(unsigned short x) {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
    return f;
}
AA_ELEM_DEV unsigned short aa_f_to_f16(float x) {
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
    return r;
}
AA_ELEM_DEV float aa_bf16_to_f(unsigned short x) { return __int_as_float((int)x << 16); }
AA_ELEM_DEV unsigned short aa_f_to_bf16(float x) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
    return r;
}
#else
#define AA_ELEM_DEV inline
#endif

template <typename T> struct AaIO {
    typedef T type;
    AA_ELEM_DEV static T to_f(T x) { return x; }
    AA_ELEM_DEV static T from_f(T x) { return x; }
};
template <> struct AaIO<AaF16> {
    typedef unsigned short type;
    AA_ELEM_DEV static float to_f(unsigned short x) { return aa_f16_to_f(x); }
    AA_ELEM_DEV static unsigned short from_f(float x) { return aa_f_to_f16(x); }
};
template <> struct AaIO<AaBF16> {
    typedef unsigned short type;
    AA_ELEM_DEV static float to_f(unsigned short x) { return aa_bf16_to_f(x); }
    AA_ELEM_DEV static unsigned short from_f(float x) { return aa_f_to_bf16(x); }
};
