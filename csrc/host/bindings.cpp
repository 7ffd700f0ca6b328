// The host compute's bindings in the module dpara_rt._core (added by bind_host, called from
// csrc/core/bindings.cpp): the host linear layer, the host Qwen3 layers, the Markov head and its bias cache, host
// verification. Buffers arrive as data_ptr() integers; the logic is in dpara_rt_host.
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "../core/bindings.h"
#include "dpara_rt/host/linear.h"
#include "dpara_rt/host/markov_bias_cache.h"
#include "dpara_rt/host/markov_head.h"
#include "dpara_rt/host/qwen3.h"
#include "dpara_rt/host/verify.h"
#include "dpara_rt/types.h"

namespace dpara_rt::bindings {

void bind_host(py::module_& m) {
  m.attr("HOST_LINEAR_PANEL") = kHostLinearPanel;  // output columns per packed panel: host_linear column ranges

  // Buffers arrive as data_ptr() integers: dpara_rt.host.native checks the tensors' shapes, dtypes and layout.
  m.def("markov_head_host", [](std::uintptr_t boundary_ptr, const std::string& boundary_dtype, std::int64_t batch,
                               std::int64_t n_rows, int d, std::int64_t vocab, const I64Array& r,
                               const I64Array& bonus, std::uintptr_t w1_ptr, std::uintptr_t w2_ptr, std::int64_t rank,
                               double temperature, std::uint64_t seed, std::uint64_t offset,
                               const py::object& draft_out, std::uintptr_t q_ptr, std::uintptr_t w2t_ptr,
                               const std::string& w2t_dtype, std::uintptr_t w2_norms_ptr, std::uintptr_t noise_ptr,
                               MarkovBiasCache* cache) {
        const DType dtype = parse_dtype(boundary_dtype), w2t = parse_dtype(w2t_dtype);
        const std::int64_t* r_data = expect_shape(r, {batch}, "r");
        const std::int64_t* bonus_data = expect_shape(bonus, {batch}, "bonus");
        std::int64_t* draft = out_data(draft_out, {batch, d}, "draft_out");
        std::int64_t row_stride;  // contiguous rows; an overflow here means a bad d or vocab, which the core names
        if (__builtin_mul_overflow(std::int64_t(d), vocab, &row_stride)) row_stride = 0;
        py::gil_scoped_release nogil;
        markov_head_host(reinterpret_cast<const void*>(boundary_ptr), dtype, batch, n_rows, d, vocab, row_stride,
                         r_data, bonus_data, reinterpret_cast<const float*>(w1_ptr),
                         reinterpret_cast<const float*>(w2_ptr), rank, temperature, seed, offset, draft,
                         reinterpret_cast<float*>(q_ptr), reinterpret_cast<const void*>(w2t_ptr), w2t,
                         reinterpret_cast<const float*>(w2_norms_ptr), reinterpret_cast<const float*>(noise_ptr),
                         cache);
      }, py::arg("boundary_ptr"), py::arg("boundary_dtype"), py::arg("batch"), py::arg("n_rows"), py::arg("d"),
      py::arg("vocab"), py::arg("r"), py::arg("bonus"), py::arg("w1_ptr"), py::arg("w2_ptr"), py::arg("rank"),
      py::arg("temperature"), py::arg("seed"), py::arg("offset"), py::arg("draft_out"), py::arg("q_ptr"),
      py::arg("w2t_ptr") = 0, py::arg("w2t_dtype") = "float32", py::arg("w2_norms_ptr") = 0, py::arg("noise_ptr") = 0,
      py::arg("cache") = nullptr,
      "Host Markov head over contiguous boundary [B, n_rows, d, V] and float32 W1 [V, R], W2 [R, V]: writes "
      "draft_out [B, d] (and q [B, d, V] at q_ptr when temperature > 0; q_ptr 0 when greedy, or when sampling "
      "with noise_ptr: the draft alone, pruned, its q from markov_q_host). w2t_ptr / "
      "w2_norms_ptr: W2 transposed [V, R] (float32, or bfloat16 holding W2 exactly) and its column norms (rounded "
      "up) for bound-pruned greedy steps, or 0. noise_ptr: the call's Gumbel noise [B, d, V] float32 from "
      "gumbel_noise_host (sampling only), or 0 to draw it here. cache: a MarkovBiasCache of these W1 / W2, or None.");
  m.def("markov_head_hidden_host", [](std::uintptr_t hidden_ptr, std::int64_t batch, std::int64_t n_rows, int d,
                                      std::int64_t hidden_dim, const I64Array& r, std::uintptr_t head_ptr,
                                      const std::string& head_format, std::int64_t vocab, std::uintptr_t logits_ptr,
                                      const I64Array& bonus, std::uintptr_t w1_ptr, std::uintptr_t w2_ptr,
                                      std::int64_t rank, double temperature, std::uint64_t seed, std::uint64_t offset,
                                      const py::object& draft_out, std::uintptr_t q_ptr, std::uintptr_t w2t_ptr,
                                      const std::string& w2t_dtype, std::uintptr_t w2_norms_ptr,
                                      std::uintptr_t noise_ptr, MarkovBiasCache* cache) {
        const PackedFormat head = parse_packed_format(head_format);
        const DType w2t = parse_dtype(w2t_dtype);
        const std::int64_t* r_data = expect_shape(r, {batch}, "r");
        const std::int64_t* bonus_data = expect_shape(bonus, {batch}, "bonus");
        std::int64_t* draft = out_data(draft_out, {batch, d}, "draft_out");
        py::gil_scoped_release nogil;
        markov_head_hidden_host(reinterpret_cast<const float*>(hidden_ptr), batch, n_rows, d, hidden_dim, r_data,
                                reinterpret_cast<const void*>(head_ptr), head, vocab,
                                reinterpret_cast<float*>(logits_ptr), bonus_data,
                                reinterpret_cast<const float*>(w1_ptr), reinterpret_cast<const float*>(w2_ptr), rank,
                                temperature, seed, offset, draft, reinterpret_cast<float*>(q_ptr),
                                reinterpret_cast<const void*>(w2t_ptr), w2t,
                                reinterpret_cast<const float*>(w2_norms_ptr), reinterpret_cast<const float*>(noise_ptr),
                                cache);
      }, py::arg("hidden_ptr"), py::arg("batch"), py::arg("n_rows"), py::arg("d"), py::arg("hidden_dim"), py::arg("r"),
      py::arg("head_ptr"), py::arg("head_format"), py::arg("vocab"), py::arg("logits_ptr"), py::arg("bonus"),
      py::arg("w1_ptr"), py::arg("w2_ptr"), py::arg("rank"), py::arg("temperature"), py::arg("seed"),
      py::arg("offset"), py::arg("draft_out"), py::arg("q_ptr"), py::arg("w2t_ptr") = 0,
      py::arg("w2t_dtype") = "float32", py::arg("w2_norms_ptr") = 0, py::arg("noise_ptr") = 0,
      py::arg("cache") = nullptr,
      "The hidden ring's head: branch r of hidden [B, n_rows, d, H] float32 through the packed output head "
      "(host_linear_pack of [V, H]) into logits [B, d, V] at logits_ptr, then markov_head_host over them; the "
      "remaining arguments as markov_head_host's.");
  m.def("markov_q_host", [](std::uintptr_t boundary_ptr, const std::string& boundary_dtype, std::int64_t batch,
                            std::int64_t n_rows, int d, std::int64_t vocab, const I64Array& r, const I64Array& bonus,
                            const I64Array& draft, std::uintptr_t w1_ptr, std::uintptr_t w2_ptr, std::int64_t rank,
                            double temperature, std::uintptr_t q_ptr, MarkovBiasCache* cache) {
        const DType dtype = parse_dtype(boundary_dtype);
        const std::int64_t* r_data = expect_shape(r, {batch}, "r");
        const std::int64_t* bonus_data = expect_shape(bonus, {batch}, "bonus");
        const std::int64_t* draft_data = expect_shape(draft, {batch, d}, "draft");
        std::int64_t row_stride;
        if (__builtin_mul_overflow(std::int64_t(d), vocab, &row_stride)) row_stride = 0;
        py::gil_scoped_release nogil;
        markov_q_host(reinterpret_cast<const void*>(boundary_ptr), dtype, batch, n_rows, d, vocab, row_stride, r_data,
                      bonus_data, draft_data, reinterpret_cast<const float*>(w1_ptr),
                      reinterpret_cast<const float*>(w2_ptr), rank, temperature, reinterpret_cast<float*>(q_ptr), cache);
      }, py::arg("boundary_ptr"), py::arg("boundary_dtype"), py::arg("batch"), py::arg("n_rows"), py::arg("d"),
      py::arg("vocab"), py::arg("r"), py::arg("bonus"), py::arg("draft"), py::arg("w1_ptr"), py::arg("w2_ptr"),
      py::arg("rank"), py::arg("temperature"), py::arg("q_ptr"), py::arg("cache") = nullptr,
      "q [B, d, V] (at q_ptr) of the sampling markov_head_host call that drafted draft [B, d], bit for bit.");
  // The factors arrive as data_ptr() integers: dpara_rt.host.native.HostMarkovHead keeps the tensors alive.
  py::class_<MarkovBiasCache>(m, "MarkovBiasCache",
                              "Bias rows W1[x] @ W2 kept for the tokens x a Markov head drafted from lately.")
      .def(py::init([](std::uintptr_t w1_ptr, std::uintptr_t w2_ptr, std::int64_t vocab, std::int64_t rank,
                       std::int64_t capacity) {
             return new MarkovBiasCache(reinterpret_cast<const float*>(w1_ptr), reinterpret_cast<const float*>(w2_ptr),
                                        vocab, rank, capacity);
           }), py::arg("w1_ptr"), py::arg("w2_ptr"), py::arg("vocab"), py::arg("rank"), py::arg("capacity"))
      .def_property_readonly("capacity", &MarkovBiasCache::capacity)
      .def_property_readonly("hits", [](MarkovBiasCache& c) {
             std::lock_guard<std::mutex> lock(c.mutex());
             return c.hits();
           }, "Steps that found their token's row.")
      .def_property_readonly("misses", [](MarkovBiasCache& c) {
             std::lock_guard<std::mutex> lock(c.mutex());
             return c.misses();
           }, "Steps that computed their token's row.")
      .def("fill", [](MarkovBiasCache& c, const I64Array& tokens) {
             if (tokens.ndim() != 1)
               throw py::value_error("tokens must have shape (n,) (token ids), got " + shape_str(tokens));
             const std::int64_t n = tokens.shape(0);
             const std::int64_t* data = tokens.data();
             py::gil_scoped_release nogil;
             markov_bias_fill(c, data, n);
           }, py::arg("tokens"),
           "Compute the rows of tokens [n] (int64) not held yet, as the steps would: see markov_bias_fill.");

  m.def("gumbel_noise_host", [](std::uintptr_t out_ptr, std::int64_t batch, int d, std::int64_t vocab,
                                std::uint64_t seed, std::uint64_t offset) {
        py::gil_scoped_release nogil;
        gumbel_noise_host(reinterpret_cast<float*>(out_ptr), batch, d, vocab, seed, offset);
      }, py::arg("out_ptr"), py::arg("batch"), py::arg("d"), py::arg("vocab"), py::arg("seed"), py::arg("offset"),
      "The Gumbel noise a sampling markov_head_host call with these (batch, d, vocab, seed, offset) draws, into "
      "out [B, d, V] float32 (contiguous).");
  m.def("host_linear_packed_elems", [](std::int64_t n, std::int64_t k, const std::string& packed_format) {
        return host_linear_packed_elems(n, k, parse_packed_format(packed_format));
      }, py::arg("n"), py::arg("k"), py::arg("packed_format") = "float32",
        "Elements of host_linear_pack's output for an n x k weight in this format.");
  m.def("host_linear_bf16_dot_native", &host_linear_bf16_dot_native,
        "Whether bf16_dot products run on this CPU's AVX512-BF16 dot product (else an emulation, the same bits).");
  // Pointers as data_ptr() integers: dpara_rt.host.linear checks the tensors.
  m.def("host_linear_pack", [](std::uintptr_t w_ptr, std::int64_t n, std::int64_t k, std::uintptr_t packed_ptr,
                               const std::string& packed_format) {
        const PackedFormat format = parse_packed_format(packed_format);
        py::gil_scoped_release nogil;
        host_linear_pack(reinterpret_cast<const float*>(w_ptr), n, k, reinterpret_cast<void*>(packed_ptr), format);
      }, py::arg("w_ptr"), py::arg("n"), py::arg("k"), py::arg("packed_ptr"), py::arg("packed_format"),
      "Pack a float32 weight [n, k] into panels: 'float32', 'bfloat16' (every weight a bfloat16 value) or "
      "'bf16_dot' (bfloat16 pairs along k, rounded: products of x rounded to bfloat16).");
  m.def("host_linear", [](std::uintptr_t x_ptr, std::int64_t m, std::int64_t k, std::uintptr_t packed_ptr,
                          const std::string& packed_format, std::int64_t n, std::uintptr_t y_ptr,
                          std::int64_t col_begin, std::int64_t col_end) {
        const PackedFormat format = parse_packed_format(packed_format);
        py::gil_scoped_release nogil;
        host_linear_columns(reinterpret_cast<const float*>(x_ptr), m, k, reinterpret_cast<const void*>(packed_ptr),
                            format, n, col_begin, col_end < 0 ? n : col_end, reinterpret_cast<float*>(y_ptr), n);
      }, py::arg("x_ptr"), py::arg("m"), py::arg("k"), py::arg("packed_ptr"), py::arg("packed_format"), py::arg("n"),
      py::arg("y_ptr"), py::arg("col_begin") = 0, py::arg("col_end") = -1,
      "y [m, n] = x [m, k] @ W^T (float32, contiguous) over W packed by host_linear_pack; releases the GIL. "
      "col_begin / col_end (-1: n), on panel edges: only those output columns are written, with the bits the "
      "whole product gives them (two processes may split one product).");
  m.def("host_linear_two_threads", [](std::uintptr_t x_ptr, std::int64_t m, std::int64_t k, std::uintptr_t packed_ptr,
                                      const std::string& packed_format, std::int64_t n, std::uintptr_t y_ptr) {
        const PackedFormat format = parse_packed_format(packed_format);
        py::gil_scoped_release nogil;
        host_linear_two_threads(reinterpret_cast<const float*>(x_ptr), m, k, reinterpret_cast<const void*>(packed_ptr),
                                format, n, reinterpret_cast<float*>(y_ptr));
      }, py::arg("x_ptr"), py::arg("m"), py::arg("k"), py::arg("packed_ptr"), py::arg("packed_format"), py::arg("n"),
      py::arg("y_ptr"),
      "host_linear over the caller and the core's helper thread when the product is large (a prefill's); the same "
      "bits. Releases the GIL.");
  // The weights' pointers stay valid while dpara_rt.host.qwen3 holds the tensors beside this object.
  py::class_<HostQwen3Weights>(m, "HostQwen3Layer",
                               "One Qwen3 decoder layer's packed weights and norms (pointers), for host_qwen3_layer.")
      .def(py::init([](std::uintptr_t qkv, std::uintptr_t o, std::uintptr_t gate_up, std::uintptr_t down,
                       const std::vector<std::string>& packed_formats, std::uintptr_t input_norm,
                       std::uintptr_t post_norm, std::uintptr_t q_norm, std::uintptr_t k_norm,
                       std::uintptr_t qkv_bias) {
             if (packed_formats.size() != 4)
               throw std::invalid_argument("HostQwen3Layer: packed_formats has " +
                                           std::to_string(packed_formats.size()) +
                                           " names; expected 4 (qkv, o, gate_up, down)");
             HostQwen3Weights w;
             const std::uintptr_t ptrs[4] = {qkv, o, gate_up, down};
             HostPackedLinear* lins[4] = {&w.qkv, &w.o, &w.gate_up, &w.down};
             for (int i = 0; i < 4; ++i)
               *lins[i] = {reinterpret_cast<const void*>(ptrs[i]), parse_packed_format(packed_formats[i])};
             w.input_norm = reinterpret_cast<const float*>(input_norm);
             w.post_norm = reinterpret_cast<const float*>(post_norm);
             w.q_norm = reinterpret_cast<const float*>(q_norm);
             w.k_norm = reinterpret_cast<const float*>(k_norm);
             w.qkv_bias = reinterpret_cast<const float*>(qkv_bias);
             return w;
           }),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("packed_formats"),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm") = 0, py::arg("k_norm") = 0,
           py::arg("qkv_bias") = 0,
           "q_norm and k_norm 0 (both): no q / k norms (the Llama family); qkv_bias 0: no bias on q, k, v.")
      .def("forward", [](const HostQwen3Weights& w, std::int64_t hidden, std::int64_t heads, std::int64_t kv_heads,
                         std::int64_t head_dim, std::int64_t intermediate, double eps, std::uintptr_t h,
                         std::int64_t batch, std::int64_t t, std::uintptr_t positions, std::uintptr_t cos,
                         std::uintptr_t sin, std::uintptr_t k_cache, std::uintptr_t v_cache, std::int64_t row_stride,
                         std::int64_t head_stride, std::int64_t max_len) {
             const HostQwen3Dims dims{hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps)};
             const HostKVLayer cache{reinterpret_cast<float*>(k_cache), reinterpret_cast<float*>(v_cache), row_stride,
                                     head_stride, max_len};
             py::gil_scoped_release nogil;
             host_qwen3_layer(dims, w, reinterpret_cast<float*>(h), batch, t,
                              reinterpret_cast<const std::int64_t*>(positions), reinterpret_cast<const float*>(cos),
                              reinterpret_cast<const float*>(sin), cache);
           },
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("h"), py::arg("batch"), py::arg("t"), py::arg("positions"), py::arg("cos"),
           py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("row_stride"), py::arg("head_stride"),
           py::arg("max_len"),
           "h [batch * t, hidden] float32 updated in place by the layer; positions [batch, t] int64; cos / sin "
           "[batch * t, head_dim]; the layer's K/V cache with the given strides (elements). Releases the GIL.");
  // A target's layers and KV cache, bound once per (packed layers, cache): a verify crosses into the core once, not
  // once per layer. The layers' tensors and the cache stay alive beside it (dpara_rt.host.qwen3).
  struct HostQwen3Stack {
    std::vector<HostQwen3Weights> weights;
    std::vector<HostKVLayer> caches;
    std::vector<std::int64_t> capture;
  };
  // A decode's verify bound once (HostQwen3Stack.verify_plan): each round passes only its tokens and buffers.
  struct HostQwen3Verify {
    const HostQwen3Stack* stack;
    HostQwen3Dims dims;
    HostQwen3Ends ends;
    std::int64_t last_capture, features_width;
    const std::int64_t* lengths;
  };
  auto host_ends = [](std::uintptr_t embed, std::int64_t vocab, std::uintptr_t cos_table, std::uintptr_t sin_table,
                      std::int64_t table_len, std::uintptr_t final_norm, double final_eps, std::uintptr_t head,
                      const std::string& head_format, std::int64_t head_vocab) {
    return HostQwen3Ends{reinterpret_cast<const float*>(embed), vocab, reinterpret_cast<const float*>(cos_table),
                         reinterpret_cast<const float*>(sin_table), table_len,
                         reinterpret_cast<const float*>(final_norm), static_cast<float>(final_eps),
                         {reinterpret_cast<const void*>(head), parse_packed_format(head_format)}, head_vocab};
  };
  // Registered before HostQwen3Stack, so that verify_plan's signature names it.
  py::class_<HostQwen3Verify> verify_type(m, "HostQwen3Verify",
                                          "A decode's verify bound once (HostQwen3Stack.verify_plan).");
  py::class_<HostQwen3Stack>(m, "HostQwen3Stack", "A target's HostQwen3Layers over its KV cache, run in one call.")
      .def(py::init([](const std::vector<const HostQwen3Weights*>& layers, std::uintptr_t k, std::uintptr_t v,
                       std::int64_t layer_stride, std::int64_t row_stride, std::int64_t head_stride,
                       std::int64_t max_len, const std::vector<std::int64_t>& capture) {
             if (capture.size() != layers.size())
               throw std::invalid_argument("HostQwen3Stack: capture has " + std::to_string(capture.size()) +
                                           " entries; expected one per layer (" + std::to_string(layers.size()) + ")");
             HostQwen3Stack st;
             for (std::size_t i = 0; i < layers.size(); ++i) {
               if (!layers[i]) throw std::invalid_argument("HostQwen3Stack: layer " + std::to_string(i) + " is None");
               st.weights.push_back(*layers[i]);
               const std::int64_t off = static_cast<std::int64_t>(i) * layer_stride;
               st.caches.push_back({reinterpret_cast<float*>(k) + off, reinterpret_cast<float*>(v) + off, row_stride,
                                    head_stride, max_len});
             }
             st.capture = capture;
             return st;
           }),
           py::arg("layers"), py::arg("k"), py::arg("v"), py::arg("layer_stride"), py::arg("row_stride"),
           py::arg("head_stride"), py::arg("max_len"), py::arg("capture"))
      .def("forward", [](const HostQwen3Stack& st, std::int64_t hidden, std::int64_t heads, std::int64_t kv_heads,
                         std::int64_t head_dim, std::int64_t intermediate, double eps, std::uintptr_t h,
                         std::int64_t batch, std::int64_t t, std::uintptr_t positions, std::uintptr_t cos,
                         std::uintptr_t sin, std::uintptr_t features, std::int64_t features_width) {
             const HostQwen3Dims dims{hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps)};
             py::gil_scoped_release nogil;
             host_qwen3_layers(dims, st.weights.data(), st.caches.data(), static_cast<std::int64_t>(st.weights.size()),
                               reinterpret_cast<float*>(h), batch, t, reinterpret_cast<const std::int64_t*>(positions),
                               reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin),
                               st.capture.data(), reinterpret_cast<float*>(features), features_width);
           },
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("h"), py::arg("batch"), py::arg("t"), py::arg("positions"), py::arg("cos"),
           py::arg("sin"), py::arg("features"), py::arg("features_width"),
           "Every layer over h [batch * t, hidden] (float32, updated in place), as HostQwen3Layer.forward each; h "
           "after layer i copied into features [batch * t, features_width] at column capture[i] where that is >= 0. "
           "Releases the GIL.")
      .def("tokens_forward", [host_ends](const HostQwen3Stack& st, std::int64_t hidden, std::int64_t heads,
                                         std::int64_t kv_heads, std::int64_t head_dim, std::int64_t intermediate,
                                         double eps, std::uintptr_t embed, std::int64_t vocab,
                                         std::uintptr_t cos_table, std::uintptr_t sin_table, std::int64_t table_len,
                                         std::uintptr_t final_norm, double final_eps, std::uintptr_t head,
                                         const std::string& head_format, std::int64_t head_vocab,
                                         std::uintptr_t tokens, std::int64_t batch, std::int64_t t,
                                         std::uintptr_t positions, std::int64_t last_capture,
                                         std::uintptr_t features, std::int64_t features_width,
                                         std::uintptr_t logits) {
             const HostQwen3Dims dims{hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps)};
             const HostQwen3Ends ends = host_ends(embed, vocab, cos_table, sin_table, table_len, final_norm, final_eps,
                                                  head, head_format, head_vocab);
             py::gil_scoped_release nogil;
             host_qwen3_tokens(dims, st.weights.data(), st.caches.data(), static_cast<std::int64_t>(st.weights.size()),
                               ends, reinterpret_cast<const std::int64_t*>(tokens), batch, t,
                               reinterpret_cast<const std::int64_t*>(positions), st.capture.data(), last_capture,
                               reinterpret_cast<float*>(features), features_width, reinterpret_cast<float*>(logits));
           },
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("embed"), py::arg("vocab"), py::arg("cos_table"), py::arg("sin_table"),
           py::arg("table_len"), py::arg("final_norm"), py::arg("final_eps"), py::arg("head"), py::arg("head_format"),
           py::arg("head_vocab"), py::arg("tokens"), py::arg("batch"), py::arg("t"), py::arg("positions"),
           py::arg("last_capture"), py::arg("features"), py::arg("features_width"), py::arg("logits"),
           "A whole forward (host_qwen3_tokens): tokens [batch, t] and positions int64, the embedding [vocab, hidden], "
           "RoPE tables [table_len, head_dim] and final norm float32, the output head packed by host_linear_pack; "
           "logits [batch * t, head_vocab] float32, the capture as forward's plus the final-normed rows at column "
           "last_capture (-1: none). Releases the GIL.")
      .def("verify_plan", [host_ends](const HostQwen3Stack& st, std::int64_t hidden, std::int64_t heads,
                                      std::int64_t kv_heads, std::int64_t head_dim, std::int64_t intermediate,
                                      double eps, std::uintptr_t embed, std::int64_t vocab, std::uintptr_t cos_table,
                                      std::uintptr_t sin_table, std::int64_t table_len, std::uintptr_t final_norm,
                                      double final_eps, std::uintptr_t head, const std::string& head_format,
                                      std::int64_t head_vocab, std::int64_t last_capture, std::int64_t features_width,
                                      std::uintptr_t lengths) {
             return HostQwen3Verify{&st, {hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps)},
                                    host_ends(embed, vocab, cos_table, sin_table, table_len, final_norm, final_eps,
                                              head, head_format, head_vocab),
                                    last_capture, features_width, reinterpret_cast<const std::int64_t*>(lengths)};
           },
           py::keep_alive<0, 1>(), py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("intermediate"), py::arg("eps"), py::arg("embed"), py::arg("vocab"), py::arg("cos_table"),
           py::arg("sin_table"), py::arg("table_len"), py::arg("final_norm"), py::arg("final_eps"), py::arg("head"),
           py::arg("head_format"), py::arg("head_vocab"), py::arg("last_capture"), py::arg("features_width"),
           py::arg("lengths"),
           "A decode's verify bound once: tokens_forward's ends and capture, and the cache's committed lengths "
           "[batch] int64, read at each run (the caller keeps every buffer alive and in place).")
      .def("block_forward", [](const HostQwen3Stack& st, std::int64_t hidden, std::int64_t heads,
                               std::int64_t kv_heads, std::int64_t head_dim, std::int64_t intermediate, double eps,
                               std::uintptr_t h, std::int64_t batch, std::int64_t t, std::uintptr_t ctx_lens,
                               std::uintptr_t visible, std::int64_t visible_stride, std::uintptr_t cos,
                               std::uintptr_t sin, std::int64_t keep_from, std::uintptr_t final_norm,
                               std::uintptr_t out) {
             const HostQwen3Dims dims{hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps)};
             py::gil_scoped_release nogil;
             host_block_layers(dims, st.weights.data(), st.caches.data(), static_cast<std::int64_t>(st.weights.size()),
                               reinterpret_cast<float*>(h), batch, t, reinterpret_cast<const std::int64_t*>(ctx_lens),
                               reinterpret_cast<const std::uint8_t*>(visible), visible_stride,
                               reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin), keep_from,
                               reinterpret_cast<const float*>(final_norm), reinterpret_cast<float*>(out));
           },
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("h"), py::arg("batch"), py::arg("t"), py::arg("ctx_lens"), py::arg("visible"),
           py::arg("visible_stride"), py::arg("cos"), py::arg("sin"), py::arg("keep_from"), py::arg("final_norm"),
           py::arg("out"),
           "A drafter's backbone (host_block_layers) over blocks of rows, its cache the drafter's context cache: h "
           "[batch * t, hidden] float32 (overwritten), ctx_lens [batch] int64, visible [t, t] or [batch, t, t] uint8 "
           "(visible_stride 0 or t * t), cos / sin [batch * t, head_dim]; out [batch * (t - keep_from), hidden] "
           "the final-normed rows keep_from.. of each block. Releases the GIL.")
      .def("context_forward", [](const HostQwen3Stack& st, std::int64_t hidden, std::int64_t heads,
                                 std::int64_t kv_heads, std::int64_t head_dim, std::int64_t intermediate, double eps,
                                 std::uintptr_t fc, const std::string& fc_format, std::int64_t feature_width,
                                 std::uintptr_t context_norm, std::uintptr_t features, std::int64_t batch,
                                 std::int64_t t, std::uintptr_t lengths, std::uintptr_t counts, std::uintptr_t cos,
                                 std::uintptr_t sin) {
             const HostQwen3Dims dims{hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps)};
             const HostPackedLinear fc_w{reinterpret_cast<const void*>(fc), parse_packed_format(fc_format)};
             py::gil_scoped_release nogil;
             host_context_kv(dims, st.weights.data(), st.caches.data(), static_cast<std::int64_t>(st.weights.size()),
                             fc_w, feature_width, reinterpret_cast<const float*>(context_norm),
                             reinterpret_cast<const float*>(features), batch, t,
                             reinterpret_cast<const std::int64_t*>(lengths),
                             reinterpret_cast<const std::int64_t*>(counts), reinterpret_cast<const float*>(cos),
                             reinterpret_cast<const float*>(sin));
           },
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("fc"), py::arg("fc_format"), py::arg("feature_width"), py::arg("context_norm"),
           py::arg("features"), py::arg("batch"), py::arg("t"), py::arg("lengths"), py::arg("counts"), py::arg("cos"),
           py::arg("sin"),
           "A drafter's context update (host_context_kv) into its context cache: features [batch * t, feature_width] "
           "float32, fc packed by host_linear_pack, lengths / counts [batch] int64, cos / sin [batch * t, head_dim] "
           "at positions lengths[b] + j. Releases the GIL.");
  verify_type.def("run", [](const HostQwen3Verify& p, std::uintptr_t tokens, std::int64_t batch, std::int64_t t,
                            std::uintptr_t features, std::uintptr_t logits, std::uintptr_t argmax_out) {
        const HostQwen3Stack& st = *p.stack;
        py::gil_scoped_release nogil;
        return host_qwen3_verify(p.dims, st.weights.data(), st.caches.data(),
                                 static_cast<std::int64_t>(st.weights.size()), p.ends,
                                 reinterpret_cast<const std::int64_t*>(tokens), batch, t, p.lengths,
                                 st.capture.data(), p.last_capture, reinterpret_cast<float*>(features),
                                 p.features_width, reinterpret_cast<float*>(logits),
                                 reinterpret_cast<std::int64_t*>(argmax_out));
      },
      py::arg("tokens"), py::arg("batch"), py::arg("t"), py::arg("features"), py::arg("logits"),
      py::arg("argmax_out"),
      "host_qwen3_verify: tokens [batch, t] int64 at each row's committed length; features [batch * t, "
      "features_width] (0 without capture), logits [batch * t, head_vocab] float32 and argmax_out [batch * t] "
      "int64 written. Returns whether every logit is finite. Releases the GIL.");
  m.def("host_rms_norm", [](std::uintptr_t x_ptr, std::uintptr_t w_ptr, std::int64_t rows, std::int64_t n, double eps,
                            std::uintptr_t out_ptr) {
        py::gil_scoped_release nogil;
        host_rms_norm(reinterpret_cast<const float*>(x_ptr), reinterpret_cast<const float*>(w_ptr), rows, n,
                      static_cast<float>(eps), reinterpret_cast<float*>(out_ptr));
      }, py::arg("x_ptr"), py::arg("w_ptr"), py::arg("rows"), py::arg("n"), py::arg("eps"), py::arg("out_ptr"),
      "out [rows, n] = RMSNorm of x [rows, n] with weight w [n] (float32, contiguous), as HostQwen3Layer's norms.");
  m.def("philox4x32", &philox4x32_10, py::arg("counter"), py::arg("offset"), py::arg("seed"),
        "First output word of Philox4x32-10 at counter (counter, offset_lo, offset_hi, 0), key seed.");
  // Buffers as data_ptr() integers (numpy views would cost more than the work at small batch): dpara_rt.host.native
  // checks the tensors; the core checks every extent, token id and uniform.
  m.def("argmax_finite_host", [](std::uintptr_t x_ptr, std::int64_t rows, std::int64_t vocab,
                                 const py::object& argmax_out) {
        std::int64_t* out = out_data(argmax_out, {rows}, "argmax_out");
        py::gil_scoped_release nogil;
        return argmax_finite_host(reinterpret_cast<const float*>(x_ptr), rows, vocab, out);
      }, py::arg("x_ptr"), py::arg("rows"), py::arg("vocab"), py::arg("argmax_out"),
      "Per row of x [rows, vocab] float32 (contiguous) the first index of its largest value, into argmax_out [rows] "
      "(int64); False (argmax_out unspecified) when any value is NaN or infinite.");
  m.def("verify_sample_host", [](std::uintptr_t p_ptr, std::uintptr_t q_ptr, std::uintptr_t draft_ptr,
                                 std::uintptr_t u_accept_ptr, std::uintptr_t u_bonus_ptr, std::int64_t batch, int d,
                                 std::int64_t vocab, std::uintptr_t r_ptr, std::uintptr_t bonus_ptr) {
        py::gil_scoped_release nogil;
        verify_sample_host(reinterpret_cast<const float*>(p_ptr), reinterpret_cast<const float*>(q_ptr),
                           reinterpret_cast<const std::int64_t*>(draft_ptr),
                           reinterpret_cast<const float*>(u_accept_ptr), reinterpret_cast<const float*>(u_bonus_ptr),
                           batch, d, vocab, reinterpret_cast<std::int64_t*>(r_ptr),
                           reinterpret_cast<std::int64_t*>(bonus_ptr));
      }, py::arg("p_ptr"), py::arg("q_ptr"), py::arg("draft_ptr"), py::arg("u_accept_ptr"), py::arg("u_bonus_ptr"),
      py::arg("batch"), py::arg("d"), py::arg("vocab"), py::arg("r_ptr"), py::arg("bonus_ptr"),
      "Lossless rejection-sampling verification (verify_sample_reference's decisions) over contiguous float32 "
      "p [B, d+1, V], q [B, d, V], u_accept [B, d], u_bonus [B] and int64 draft [B, d]: writes int64 r and bonus "
      "[B] at r_ptr and bonus_ptr.");

  m.def("inverse_cdf_host", [](std::uintptr_t w_ptr, std::uintptr_t u_ptr, std::int64_t rows, std::int64_t vocab,
                               std::uintptr_t out_ptr) {
        py::gil_scoped_release nogil;
        inverse_cdf_host(reinterpret_cast<const float*>(w_ptr), reinterpret_cast<const float*>(u_ptr), rows, vocab,
                         reinterpret_cast<std::int64_t*>(out_ptr));
      }, py::arg("w_ptr"), py::arg("u_ptr"), py::arg("rows"), py::arg("vocab"), py::arg("out_ptr"),
      "inverse_cdf's draw over contiguous float32 weights w [rows, vocab] and uniforms u [rows]: writes int64 "
      "[rows] at out_ptr.");
}

}  // namespace dpara_rt::bindings
