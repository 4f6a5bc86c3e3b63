// The torch operator llama_mini::flush_subnormals(on): every CPU thread of the process reads
// and writes subnormal floats (below 1.2e-38) as zero (x86's DAZ and FTZ bits), or as they are.
//
// Why an operator: the mode is each thread's own. torch.set_flush_denormal sets the calling
// thread's alone, and torch's worker threads start without it. A parallel loop of one item
// per thread runs the setting on each of torch's threads, and an OpenMP region on each of
// this library's, where its OpenMP runtime is another than torch's.

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

namespace llama_mini {

bool flush_subnormals(bool on) {
    std::atomic<bool> every{at::globalContext().setFlushDenormal(on)};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
        if (!at::globalContext().setFlushDenormal(on)) every = false;
    });
#pragma omp parallel
    if (!at::globalContext().setFlushDenormal(on)) every = false;
    return every;
}

}  // namespace llama_mini

TORCH_LIBRARY_FRAGMENT(llama_mini, m) { m.def("flush_subnormals(bool on) -> bool", llama_mini::flush_subnormals); }
