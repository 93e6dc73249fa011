"""The mixture-of-experts kernels of the cuda lane: routing (`route`), the kept experts' gate/up products with
their SwiGLU (`gate_up`), and their down products with the weighted combine, the shared expert, the residual
add and the next norm (`down`). Expert ids stay on the device, so a decode step's launches are capturable."""
