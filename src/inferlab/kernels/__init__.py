"""The CPU kernels and the Python that builds, picks and calls them; depends on model/ only.

isa (the instruction sets the kernels are built for, and which this CPU runs), build (compile and load csrc/
once per machine and instruction set, choose the one a process calls, and which kernels apply to a device), gemv (the
matrix-vector products per weight format), attention (single-query attention through block tables),
fused_decode (the whole decode step in one C++ call), aten (aten's integer matmuls and their weight
layouts), huge_pages (the weights and KV pools on 2 MiB pages), layer (KernelLayer: what a layer hands the kernels),
select (put a model's layers on the kernels).
"""
