#include "tasks/text_lm.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "core/types.hpp"

namespace relpos::tasks {

std::vector<int64_t> byte_tokens(std::string_view bytes) {
  std::vector<int64_t> t(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i)
    t[i] = static_cast<int64_t>(static_cast<uint8_t>(bytes[i])) + 1;
  return t;
}

TokenCorpus byte_corpus(const std::filesystem::path& train_file,
                        const std::filesystem::path& validation_file) {
  return {byte_tokens(read_file_bytes(train_file)), byte_tokens(read_file_bytes(validation_file)),
          kByteVocab};
}

TokenCorpus byte_corpus_split(const std::filesystem::path& file, double validation_fraction) {
  return byte_stream_split(read_file_bytes(file), validation_fraction);
}

TokenCorpus byte_stream_split(std::string_view bytes, double validation_fraction) {
  std::vector<int64_t> all = byte_tokens(bytes);
  const auto cut =
      static_cast<size_t>(split_point(static_cast<int64_t>(all.size()), validation_fraction));
  TokenCorpus c;
  c.validation.assign(all.begin() + static_cast<ptrdiff_t>(cut), all.end());
  all.resize(cut);
  c.train = std::move(all);
  c.vocab_size = kByteVocab;
  return c;
}

std::u32string decode_utf8(std::string_view bytes, const std::string& source) {
  std::u32string out;
  out.reserve(bytes.size());
  const size_t n = bytes.size();
  auto fail = [&](size_t at, const char* why) {
    return InputError(fmt::format("{}: invalid UTF-8 at byte offset {}: {}", source, at, why));
  };
  for (size_t i = 0; i < n;) {
    const auto b0 = static_cast<uint8_t>(bytes[i]);
    if (b0 < 0x80) {
      out.push_back(b0);
      ++i;
      continue;
    }
    int len = 0;
    char32_t cp = 0, min = 0;
    if ((b0 & 0xE0) == 0xC0) {
      len = 2, cp = b0 & 0x1F, min = 0x80;
    } else if ((b0 & 0xF0) == 0xE0) {
      len = 3, cp = b0 & 0x0F, min = 0x800;
    } else if ((b0 & 0xF8) == 0xF0) {
      len = 4, cp = b0 & 0x07, min = 0x10000;
    } else {
      throw fail(
          i, (b0 & 0xC0) == 0x80 ? "continuation byte without a lead byte" : "invalid lead byte");
    }
    if (n - i < static_cast<size_t>(len))
      throw fail(i, "sequence truncated by the end of the file");
    for (int k = 1; k < len; ++k) {
      const auto bk = static_cast<uint8_t>(bytes[i + static_cast<size_t>(k)]);
      if ((bk & 0xC0) != 0x80) throw fail(i, "expected a continuation byte");
      cp = (cp << 6) | (bk & 0x3F);
    }
    if (cp < min) throw fail(i, "overlong encoding");
    if (cp > 0x10FFFF) throw fail(i, "code point above U+10FFFF");
    if (cp >= 0xD800 && cp <= 0xDFFF) throw fail(i, "surrogate code point");
    out.push_back(cp);
    i += static_cast<size_t>(len);
  }
  return out;
}

std::string encode_utf8(std::u32string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t c : text) {
    if (c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) c = 0xFFFD;
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else if (c < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (c >> 6)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    } else if (c < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (c >> 12)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (c >> 18)));
      out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
  }
  return out;
}

int64_t CharVocab::id(char32_t c) const {
  const auto it = std::lower_bound(chars.begin(), chars.end(), c);
  return it != chars.end() && *it == c ? it - chars.begin() : -1;
}

std::string CharVocab::decode(std::span<const int64_t> ids) const {
  std::u32string text;
  text.reserve(ids.size());
  for (int64_t i : ids)
    text.push_back(i >= 0 && i < static_cast<int64_t>(chars.size()) ? chars[static_cast<size_t>(i)]
                                                                    : char32_t{0xFFFD});
  return encode_utf8(text);
}

namespace {

// Byte offset of code point `index` of valid UTF-8 `bytes` (for messages only).
size_t utf8_offset(std::string_view bytes, size_t index) {
  size_t off = 0;
  for (size_t cp = 0; off < bytes.size(); ++off)
    if ((static_cast<uint8_t>(bytes[off]) & 0xC0) != 0x80 && cp++ == index) return off;
  return off;
}

// `text` (code points [first, last) of the UTF-8 `bytes` of `source`) to ids of `vocab`.
std::vector<int64_t> to_ids(std::u32string_view text, const CharVocab& vocab,
                            std::string_view bytes, size_t first, const std::string& source,
                            int64_t& unknown) {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    int64_t id = vocab.id(text[i]);
    if (id < 0) {
      if (vocab.unknown_id < 0)
        throw InputError(fmt::format(
            "{}: character U+{:04X} at byte offset {} is not in the training vocabulary ({} "
            "characters); use UnknownChars::ReservedId to map such characters to one extra id",
            source, static_cast<uint32_t>(text[i]), utf8_offset(bytes, first + i),
            vocab.chars.size()));
      id = vocab.unknown_id;
      ++unknown;
    }
    ids[i] = id;
  }
  return ids;
}

CharVocab make_vocab(std::u32string_view train, UnknownChars unknown, const std::string& source) {
  CharVocab v;
  v.chars.assign(train.begin(), train.end());
  std::sort(v.chars.begin(), v.chars.end());
  v.chars.erase(std::unique(v.chars.begin(), v.chars.end()), v.chars.end());
  if (v.chars.empty())
    throw InputError(fmt::format("{}: no characters in the training text", source));
  if (unknown == UnknownChars::ReservedId) v.unknown_id = static_cast<int64_t>(v.chars.size());
  return v;
}

}  // namespace

CharCorpus char_corpus(const std::filesystem::path& train_file,
                       const std::filesystem::path& validation_file, UnknownChars unknown) {
  const std::string tb = read_file_bytes(train_file), vb = read_file_bytes(validation_file);
  const std::u32string tt = decode_utf8(tb, train_file.string());
  const std::u32string vt = decode_utf8(vb, validation_file.string());
  CharCorpus c;
  c.vocab = make_vocab(tt, unknown, train_file.string());
  int64_t none = 0;
  c.tokens.train = to_ids(tt, c.vocab, tb, 0, train_file.string(), none);
  c.tokens.validation =
      to_ids(vt, c.vocab, vb, 0, validation_file.string(), c.unknown_in_validation);
  c.tokens.vocab_size = c.vocab.size();
  return c;
}

CharCorpus char_corpus_split(const std::filesystem::path& file, double validation_fraction,
                             UnknownChars unknown) {
  const std::string bytes = read_file_bytes(file);
  const std::u32string text = decode_utf8(bytes, file.string());
  const auto cut =
      static_cast<size_t>(split_point(static_cast<int64_t>(text.size()), validation_fraction));
  const std::u32string_view all(text);
  CharCorpus c;
  c.vocab = make_vocab(all.substr(0, cut), unknown, file.string());
  int64_t none = 0;
  c.tokens.train = to_ids(all.substr(0, cut), c.vocab, bytes, 0, file.string(), none);
  c.tokens.validation =
      to_ids(all.substr(cut), c.vocab, bytes, cut, file.string(), c.unknown_in_validation);
  c.tokens.vocab_size = c.vocab.size();
  return c;
}

}  // namespace relpos::tasks
