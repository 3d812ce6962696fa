# ggml's AMX matrix kernels are left out of every build of the pin, the engine's and the
# references' alike. At the pin they crash on some Sapphire Rapids machines: the first
# matmul of a quantized model segfaults in ggml_backend_amx_mul_mat (ggml-org/llama.cpp
# #20824, open; ollama builds without them). -march=native turns them on wherever the CPU
# has AMX, so the stock class (which takes llama.cpp's extra weight layouts) crashed there
# while the invariant class, which takes none, ran. Without them both use the AVX-512 kernels.
include(CheckCCompilerFlag)
check_c_compiler_flag(-mno-amx-int8 MESHNET_CC_HAS_MNO_AMX)
if(MESHNET_CC_HAS_MNO_AMX)
    # C and C++ only: a CUDA build's nvcc takes no such flag
    add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-mno-amx-tile;-mno-amx-int8;-mno-amx-bf16>")
endif()
set(GGML_AMX_TILE OFF CACHE BOOL "" FORCE)
set(GGML_AMX_INT8 OFF CACHE BOOL "" FORCE)
set(GGML_AMX_BF16 OFF CACHE BOOL "" FORCE)
