// Index construction for GPT datasets: the sample index and the blending index.
//
// Everything is 64-bit: token counts, document offsets and the stored arrays, so datasets of more
// than 2^31 tokens (or documents) index correctly. The loops run without the GIL.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// Fills out[0 .. 2*(num_samples+1)) with (index into doc_idx, token offset in that document).
// Sample i covers the tokens from row i to row i+1, the end offset included: seq_length + 1 tokens,
// so consecutive samples share one token.
template <typename SizeT>
void fill_sample_idx(const SizeT* sizes, int64_t num_documents, const int64_t* doc_idx,
                     int64_t doc_idx_length, int64_t seq_length, int64_t num_samples,
                     int64_t* out) {
  int64_t doc_idx_index = 0;
  int64_t doc_offset = 0;
  out[0] = 0;
  out[1] = 0;
  for (int64_t sample_index = 1; sample_index <= num_samples; ++sample_index) {
    int64_t remaining = seq_length + 1;
    while (remaining != 0) {
      if (doc_idx_index >= doc_idx_length) {
        throw std::invalid_argument(
            "build_sample_idx: doc_idx ran out of documents at sample " +
            std::to_string(sample_index) + "; tokens_per_epoch does not match the sizes of doc_idx");
      }
      const int64_t doc_id = doc_idx[doc_idx_index];
      if (doc_id < 0 || doc_id >= num_documents) {
        throw std::invalid_argument("build_sample_idx: doc_idx[" + std::to_string(doc_idx_index) +
                                    "] = " + std::to_string(doc_id) + " is outside sizes (" +
                                    std::to_string(num_documents) + " documents)");
      }
      const int64_t doc_length = static_cast<int64_t>(sizes[doc_id]) - doc_offset;
      remaining -= doc_length;
      if (remaining <= 0) {
        // The sample ends inside this document; the next one starts on its last token.
        doc_offset += remaining + doc_length - 1;
        remaining = 0;
      } else {
        ++doc_idx_index;
        doc_offset = 0;
      }
    }
    out[2 * sample_index] = doc_idx_index;
    out[2 * sample_index + 1] = doc_offset;
  }
}

template <typename SizeT>
py::array_t<int64_t> build_sample_idx(const py::array_t<SizeT, py::array::c_style>& sizes,
                                      const py::array_t<int64_t, py::array::c_style>& doc_idx,
                                      int64_t seq_length, int64_t num_epochs,
                                      int64_t tokens_per_epoch) {
  if (seq_length <= 0) {
    throw std::invalid_argument("build_sample_idx: seq_length must be positive, got " +
                                std::to_string(seq_length));
  }
  if (num_epochs <= 0 || tokens_per_epoch <= 0) {
    throw std::invalid_argument("build_sample_idx: num_epochs and tokens_per_epoch must be "
                                "positive, got " + std::to_string(num_epochs) + " and " +
                                std::to_string(tokens_per_epoch));
  }
  if (tokens_per_epoch > std::numeric_limits<int64_t>::max() / num_epochs) {
    throw std::invalid_argument("build_sample_idx: num_epochs * tokens_per_epoch overflows int64");
  }
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
  py::array_t<int64_t> sample_idx({num_samples + 1, static_cast<int64_t>(2)});
  const SizeT* sizes_ptr = sizes.data();
  const int64_t num_documents = sizes.size();
  const int64_t* doc_idx_ptr = doc_idx.data();
  const int64_t doc_idx_length = doc_idx.size();
  int64_t* out = sample_idx.mutable_data();
  {
    py::gil_scoped_release release;
    fill_sample_idx(sizes_ptr, num_documents, doc_idx_ptr, doc_idx_length, seq_length, num_samples,
                    out);
  }
  return sample_idx;
}

// Greedy deficit: sample k goes to the dataset d maximising weight_d * max(k, 1) - count_d, the
// first such d on ties. dataset_sample_index[k] is count_d before the increment. Raises if a
// dataset would be asked for a sample at or past its length.
py::tuple build_blending_indices(const py::array_t<double, py::array::c_style>& weights,
                                 const py::array_t<int64_t, py::array::c_style>& dataset_sizes,
                                 int64_t size) {
  const int64_t num_datasets = weights.size();
  if (num_datasets == 0 || dataset_sizes.size() != num_datasets) {
    throw std::invalid_argument("build_blending_indices: need one size per weight and at least "
                                "one dataset");
  }
  if (num_datasets > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("build_blending_indices: too many datasets");
  }
  if (size < 0) {
    throw std::invalid_argument("build_blending_indices: size must be non-negative");
  }
  const double* w = weights.data();
  double total = 0.0;
  for (int64_t d = 0; d < num_datasets; ++d) {
    if (!(w[d] >= 0.0) || w[d] == std::numeric_limits<double>::infinity()) {
      throw std::invalid_argument("build_blending_indices: weight " + std::to_string(d) +
                                  " must be finite and non-negative");
    }
    total += w[d];
  }
  if (!(total > 0.0)) {
    throw std::invalid_argument("build_blending_indices: the weights sum to zero");
  }
  std::vector<double> normalized(w, w + num_datasets);
  for (double& value : normalized) value /= total;
  const int64_t* lengths = dataset_sizes.data();

  py::array_t<int32_t> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  int32_t* index_out = dataset_index.mutable_data();
  int64_t* sample_out = dataset_sample_index.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> counts(num_datasets, 0);
    for (int64_t k = 0; k < size; ++k) {
      const double position = std::max(static_cast<double>(k), 1.0);
      int64_t best = 0;
      double best_error = normalized[0] * position - static_cast<double>(counts[0]);
      for (int64_t d = 1; d < num_datasets; ++d) {
        const double error = normalized[d] * position - static_cast<double>(counts[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      if (counts[best] >= lengths[best]) {
        throw std::invalid_argument(
            "build_blending_indices: blended sample " + std::to_string(k) + " needs sample " +
            std::to_string(counts[best]) + " of dataset " + std::to_string(best) +
            ", which has only " + std::to_string(lengths[best]) + " samples");
      }
      index_out[k] = static_cast<int32_t>(best);
      sample_out[k] = counts[best];
      ++counts[best];
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

}  // namespace

PYBIND11_MODULE(_helpers, m) {
  m.doc() = "Sample-index and blending-index construction for GPT datasets (64-bit).";
  const char* sample_doc =
      "build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch) -> int64 "
      "[N + 1, 2] with N = (num_epochs * tokens_per_epoch - 1) // seq_length; row i is (index "
      "into doc_idx, token offset) where sample i starts.";
  m.def("build_sample_idx", &build_sample_idx<int32_t>, sample_doc, py::arg("sizes"),
        py::arg("doc_idx"), py::arg("seq_length"), py::arg("num_epochs"),
        py::arg("tokens_per_epoch"));
  m.def("build_sample_idx", &build_sample_idx<int64_t>, sample_doc, py::arg("sizes"),
        py::arg("doc_idx"), py::arg("seq_length"), py::arg("num_epochs"),
        py::arg("tokens_per_epoch"));
  m.def("build_blending_indices", &build_blending_indices,
        "build_blending_indices(weights, dataset_sizes, size) -> (dataset_index int32[size], "
        "dataset_sample_index int64[size]) by greedy deficit; raises ValueError when a dataset "
        "would be read past its length.",
        py::arg("weights"), py::arg("dataset_sizes"), py::arg("size"));
}
