// Byte-level and character-level language-model corpora from text files.
//
// Byte level (jordan-rope.md 3.6): the file's bytes as stored (no decoding or cleaning), token =
// byte + 1 in 1..256, vocabulary 257 (token 0 unused, as in the reference).
// Character level (the JoFormer char LM, grape-joformer.md): the file decoded as UTF-8 (strictly:
// malformed, overlong, surrogate or out-of-range sequences are errors that name the byte offset);
// the vocabulary is the sorted distinct code points of the training text, ids 0..V-1 in that
// order. A leading byte-order mark is an ordinary character (U+FEFF).
// Both split one file by a validation fraction (the first floor((1 - f) N) units train, at byte
// resp. code-point granularity) or take a separate validation file. The reference LM with a single
// `text_file` evaluates on the training stream itself: pass the same file twice for that.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tasks/corpus.hpp"

namespace relpos::tasks {

inline constexpr int64_t kByteVocab = 257;

std::vector<int64_t> byte_tokens(std::string_view bytes);  // byte + 1
TokenCorpus byte_corpus(const std::filesystem::path& train_file,
                        const std::filesystem::path& validation_file);
TokenCorpus byte_corpus_split(const std::filesystem::path& file, double validation_fraction);
// The same on bytes in memory (a corpus built on the fly), split by split_point.
TokenCorpus byte_stream_split(std::string_view bytes, double validation_fraction);

// Strict UTF-8 decoding (RFC 3629). InputError "SOURCE: invalid UTF-8 at byte offset N: WHY".
std::u32string decode_utf8(std::string_view bytes, const std::string& source);
std::string encode_utf8(std::u32string_view text);

// What a character missing from the training vocabulary becomes in the validation text.
enum class UnknownChars {
  Error,       // InputError naming the file, the byte offset and the code point (the default)
  ReservedId,  // one extra id V, after the known characters: vocab_size = V + 1
};

struct CharVocab {
  std::u32string chars;     // sorted, distinct
  int64_t unknown_id = -1;  // V with UnknownChars::ReservedId, else -1
  int64_t size() const { return static_cast<int64_t>(chars.size()) + (unknown_id >= 0 ? 1 : 0); }
  int64_t id(char32_t c) const;  // -1 when c is not in the vocabulary
  // Ids back to UTF-8 text; the unknown id and out-of-range ids become U+FFFD.
  std::string decode(std::span<const int64_t> ids) const;
};

struct CharCorpus {
  TokenCorpus tokens;  // tokens.vocab_size == vocab.size()
  CharVocab vocab;
  int64_t unknown_in_validation = 0;  // characters mapped to the reserved id
};

CharCorpus char_corpus(const std::filesystem::path& train_file,
                       const std::filesystem::path& validation_file,
                       UnknownChars unknown = UnknownChars::Error);
CharCorpus char_corpus_split(const std::filesystem::path& file, double validation_fraction,
                             UnknownChars unknown = UnknownChars::Error);

}  // namespace relpos::tasks
