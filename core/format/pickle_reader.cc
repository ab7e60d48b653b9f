#include "core/format/pickle_reader.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "core/format/pickle_text.h"
#include "core/util/checked.h"

namespace ucp::pickle {

namespace {

// Python's int() refuses decimal text longer than this (sys.int_info.default_max_str_digits);
// it also keeps the quadratic text → binary conversion cheap.
constexpr size_t kMaxDecimalDigits = 4300;

std::string_view OpcodeName(uint8_t op) {
  switch (op) {
    case '(':
      return "MARK";
    case '.':
      return "STOP";
    case '0':
      return "POP";
    case '1':
      return "POP_MARK";
    case '2':
      return "DUP";
    case 'F':
      return "FLOAT";
    case 'I':
      return "INT";
    case 'J':
      return "BININT";
    case 'K':
      return "BININT1";
    case 'L':
      return "LONG";
    case 'M':
      return "BININT2";
    case 'N':
      return "NONE";
    case 'P':
      return "PERSID";
    case 'Q':
      return "BINPERSID";
    case 'R':
      return "REDUCE";
    case 'S':
      return "STRING";
    case 'T':
      return "BINSTRING";
    case 'U':
      return "SHORT_BINSTRING";
    case 'V':
      return "UNICODE";
    case 'X':
      return "BINUNICODE";
    case 'a':
      return "APPEND";
    case 'b':
      return "BUILD";
    case 'c':
      return "GLOBAL";
    case 'd':
      return "DICT";
    case '}':
      return "EMPTY_DICT";
    case 'e':
      return "APPENDS";
    case 'g':
      return "GET";
    case 'h':
      return "BINGET";
    case 'i':
      return "INST";
    case 'j':
      return "LONG_BINGET";
    case 'l':
      return "LIST";
    case ']':
      return "EMPTY_LIST";
    case 'o':
      return "OBJ";
    case 'p':
      return "PUT";
    case 'q':
      return "BINPUT";
    case 'r':
      return "LONG_BINPUT";
    case 's':
      return "SETITEM";
    case 't':
      return "TUPLE";
    case ')':
      return "EMPTY_TUPLE";
    case 'u':
      return "SETITEMS";
    case 'G':
      return "BINFLOAT";
    case 0x80:
      return "PROTO";
    case 0x81:
      return "NEWOBJ";
    case 0x82:
      return "EXT1";
    case 0x83:
      return "EXT2";
    case 0x84:
      return "EXT4";
    case 0x85:
      return "TUPLE1";
    case 0x86:
      return "TUPLE2";
    case 0x87:
      return "TUPLE3";
    case 0x88:
      return "NEWTRUE";
    case 0x89:
      return "NEWFALSE";
    case 0x8a:
      return "LONG1";
    case 0x8b:
      return "LONG4";
    case 'B':
      return "BINBYTES";
    case 'C':
      return "SHORT_BINBYTES";
    case 0x8c:
      return "SHORT_BINUNICODE";
    case 0x8d:
      return "BINUNICODE8";
    case 0x8e:
      return "BINBYTES8";
    case 0x8f:
      return "EMPTY_SET";
    case 0x90:
      return "ADDITEMS";
    case 0x91:
      return "FROZENSET";
    case 0x92:
      return "NEWOBJ_EX";
    case 0x93:
      return "STACK_GLOBAL";
    case 0x94:
      return "MEMOIZE";
    case 0x95:
      return "FRAME";
    case 0x96:
      return "BYTEARRAY8";
    case 0x97:
      return "NEXT_BUFFER";
    case 0x98:
      return "READONLY_BUFFER";
    default:
      return {};
  }
}

// Decimal text (optional sign) → minimal little-endian two's complement bytes.
std::optional<std::string> DecimalToTwosComplement(std::string_view text) {
  bool negative = false;
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) {
    negative = text[0] == '-';
    text.remove_prefix(1);
  }
  if (text.empty() || text.size() > kMaxDecimalDigits) return std::nullopt;
  std::string magnitude;  // little-endian
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    unsigned carry = static_cast<unsigned>(c - '0');
    for (char& byte : magnitude) {
      const unsigned cur = static_cast<uint8_t>(byte) * 10u + carry;
      byte = static_cast<char>(cur & 0xff);
      carry = cur >> 8;
    }
    if (carry != 0) magnitude += static_cast<char>(carry);
  }
  magnitude += '\0';  // room for the sign bit
  if (negative) {
    bool carry = true;
    for (char& byte : magnitude) {
      auto u = static_cast<uint8_t>(~static_cast<uint8_t>(byte));
      if (carry) {
        ++u;
        carry = u == 0;
      }
      byte = static_cast<char>(u);
    }
  }
  return magnitude;
}

class Unpickler {
 public:
  Unpickler(std::string_view bytes, const ReadOptions& options)
      : in_(bytes), name_(options.name), limits_(options.limits) {}

  Result<Graph> Run() {
    while (true) {
      op_offset_ = pos_;
      if (pos_ >= in_.size()) {
        op_ = 0;
        return Status::Corrupt("pickle: " + name_ + " offset " + std::to_string(pos_) +
                               ": truncated input: no STOP opcode");
      }
      op_ = static_cast<uint8_t>(in_[pos_++]);
      if (op_ == '.') {
        UCP_ASSIGN_OR_RETURN(Value * root, Pop());
        graph_.set_root(root);
        return std::move(graph_);
      }
      UCP_RETURN_IF_ERROR(Step());
      if (graph_.size() > limits_.max_nodes) {
        return Fail(StatusCode::kOutOfRange,
                    "more than " + std::to_string(limits_.max_nodes) + " values");
      }
    }
  }

 private:
  Status Fail(StatusCode code, const std::string& what) const {
    const std::string_view op_name = OpcodeName(op_);
    std::string message =
        "pickle: " + name_ + " offset " + std::to_string(op_offset_) + ": " + what;
    if (!op_name.empty()) message += " at " + std::string(op_name);
    return Status(code, std::move(message));
  }
  Status Corrupt(const std::string& what) const { return Fail(StatusCode::kCorrupt, what); }

  // ---- operands ----

  Result<std::string_view> Read(uint64_t n) {
    if (!RangeWithin(pos_, n, in_.size())) return Corrupt("truncated input");
    std::string_view out = in_.substr(pos_, n);
    pos_ += n;
    return out;
  }

  Result<uint64_t> ReadUnsigned(size_t width) {
    UCP_ASSIGN_OR_RETURN(std::string_view b, Read(width));
    uint64_t v = 0;
    for (size_t i = 0; i < width; ++i) v |= uint64_t{static_cast<uint8_t>(b[i])} << (8 * i);
    return v;
  }

  Result<int32_t> ReadInt32() {
    UCP_ASSIGN_OR_RETURN(uint64_t u, ReadUnsigned(4));
    return static_cast<int32_t>(static_cast<uint32_t>(u));
  }

  // A length operand; must fit the payload limit and the remaining input.
  Result<uint64_t> ReadLength(size_t width, bool is_signed) {
    UCP_ASSIGN_OR_RETURN(uint64_t n, ReadUnsigned(width));
    if (is_signed && (n & 0x80000000u) != 0) return Corrupt("negative length");
    if (n > limits_.max_payload) {
      return Fail(StatusCode::kOutOfRange, "length " + std::to_string(n) + " over the limit of " +
                                               std::to_string(limits_.max_payload));
    }
    if (n > in_.size() - pos_) {
      return Corrupt("truncated input: length " + std::to_string(n) + " with " +
                     std::to_string(in_.size() - pos_) + " bytes left");
    }
    return n;
  }

  // Text up to (not including) the next LF, which is consumed.
  Result<std::string_view> ReadLine() {
    const size_t end = in_.find('\n', pos_);
    if (end == std::string_view::npos) return Corrupt("truncated input: line without newline");
    if (end - pos_ > limits_.max_payload) return Fail(StatusCode::kOutOfRange, "line too long");
    std::string_view line = in_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return line;
  }

  Result<uint64_t> ParseIndex(std::string_view text) {
    uint64_t v = 0;
    const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || ptr != text.data() + text.size() || text.empty()) {
      return Corrupt("malformed memo index");
    }
    return v;
  }

  // ---- stacks ----

  size_t Fence() const { return marks_.empty() ? 0 : marks_.back(); }

  Status Push(Value* v) {
    if (stack_.size() >= limits_.max_stack) {
      return Fail(StatusCode::kOutOfRange,
                  "stack deeper than " + std::to_string(limits_.max_stack));
    }
    stack_.push_back(v);
    return Status::Ok();
  }

  Result<Value*> Pop() {
    if (stack_.size() <= Fence()) return Corrupt("stack underflow");
    Value* v = stack_.back();
    stack_.pop_back();
    return v;
  }

  Result<Value*> Top() {
    if (stack_.size() <= Fence()) return Corrupt("stack underflow");
    return stack_.back();
  }

  // Pops everything above the top mark, and the mark.
  Result<std::vector<Value*>> PopMark() {
    if (marks_.empty()) return Corrupt("MARK stack underflow");
    const size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<Value*> items(stack_.begin() + static_cast<ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return items;
  }

  // ---- depth bookkeeping ----

  // Records that `parent` now contains `child`.
  Status Contain(Value* parent, const Value* child) {
    const uint32_t d = depth_[child] + 1;
    if (d > limits_.max_depth) {
      return Fail(StatusCode::kOutOfRange,
                  "nesting deeper than " + std::to_string(limits_.max_depth));
    }
    uint32_t& mine = depth_[parent];
    mine = std::max(mine, d);
    return Status::Ok();
  }

  Status ContainAll(Value* parent, const std::vector<Value*>& children) {
    depth_[parent] = 1;
    for (const Value* c : children) UCP_RETURN_IF_ERROR(Contain(parent, c));
    return Status::Ok();
  }

  // ---- value builders ----

  Status PushSequence(Kind kind, std::vector<Value*> items) {
    Value* v = nullptr;
    switch (kind) {
      case Kind::kTuple:
        v = graph_.Tuple(std::move(items));
        break;
      case Kind::kList:
        v = graph_.List(std::move(items));
        break;
      case Kind::kFrozenSet:
        v = graph_.FrozenSet(std::move(items));
        break;
      default:
        return Status::Internal("pickle: PushSequence of " + std::string(KindName(kind)));
    }
    UCP_RETURN_IF_ERROR(ContainAll(v, v->items()));
    return Push(v);
  }

  Status PushDict(const std::vector<Value*>& flat) {
    if (flat.size() % 2 != 0) return Corrupt("odd number of items");
    std::vector<std::pair<Value*, Value*>> entries;
    entries.reserve(flat.size() / 2);
    for (size_t i = 0; i < flat.size(); i += 2) entries.emplace_back(flat[i], flat[i + 1]);
    Value* v = graph_.Dict(std::move(entries));
    UCP_RETURN_IF_ERROR(ContainAll(v, flat));
    return Push(v);
  }

  Status PushObject(Construction how, Value* callable, Value* args, Value* kwargs) {
    if (args->kind() != Kind::kTuple) {
      return Corrupt("argument list is a " + std::string(KindName(args->kind())) + ", not a tuple");
    }
    if (kwargs != nullptr && kwargs->kind() != Kind::kDict) {
      return Corrupt("keyword arguments are a " + std::string(KindName(kwargs->kind())) +
                     ", not a dict");
    }
    Value* v = graph_.Object(how, callable, args, kwargs);
    depth_[v] = 1;
    UCP_RETURN_IF_ERROR(Contain(v, callable));
    UCP_RETURN_IF_ERROR(Contain(v, args));
    if (kwargs != nullptr) UCP_RETURN_IF_ERROR(Contain(v, kwargs));
    return Push(v);
  }

  Status PushStr(std::string utf8, bool allow_surrogates) {
    if (!IsValidUtf8(utf8, allow_surrogates)) return Corrupt("invalid UTF-8");
    return Push(graph_.Str(std::move(utf8)));
  }

  Status PushInt(std::string_view text) {
    auto bytes = DecimalToTwosComplement(text);
    if (!bytes) return Corrupt("malformed integer text");
    return Push(graph_.IntFromBytes(*bytes));
  }

  Status PushGlobal(std::string_view module, std::string_view name) {
    if (!IsValidUtf8(module, false) || !IsValidUtf8(name, false)) {
      return Corrupt("global name is not UTF-8");
    }
    return Push(graph_.Global(std::string(module), std::string(name)));
  }

  // What a container-mutating opcode applies to: a list, dict or set by kind, an object by
  // recording the mutation.
  Status CheckMutable(const Value* target, Kind plain) {
    if (target->kind() == plain || target->kind() == Kind::kObject) return Status::Ok();
    const StatusCode code =
        (target->kind() == Kind::kGlobal || target->kind() == Kind::kPersistentId ||
         target->kind() == Kind::kExtension)
            ? StatusCode::kUnsupported
            : StatusCode::kCorrupt;
    return Fail(code, "target is " + std::string(KindName(target->kind())));
  }

  Status Append(Value* target, const std::vector<Value*>& items) {
    UCP_RETURN_IF_ERROR(CheckMutable(target, Kind::kList));
    for (Value* item : items) {
      UCP_RETURN_IF_ERROR(Contain(target, item));
      if (target->kind() == Kind::kList) {
        target->mutable_items().push_back(item);
      } else {
        target->mutable_mutations().push_back({Mutation::Op::kAppend, item, nullptr});
      }
    }
    return Status::Ok();
  }

  Status SetItems(Value* target, const std::vector<Value*>& flat) {
    if (flat.size() % 2 != 0) return Corrupt("odd number of items");
    UCP_RETURN_IF_ERROR(CheckMutable(target, Kind::kDict));
    for (size_t i = 0; i < flat.size(); i += 2) {
      UCP_RETURN_IF_ERROR(Contain(target, flat[i]));
      UCP_RETURN_IF_ERROR(Contain(target, flat[i + 1]));
      if (target->kind() == Kind::kDict) {
        target->mutable_entries().emplace_back(flat[i], flat[i + 1]);
      } else {
        target->mutable_mutations().push_back({Mutation::Op::kSetItem, flat[i], flat[i + 1]});
      }
    }
    return Status::Ok();
  }

  // The object below the top mark, for APPENDS/SETITEMS/ADDITEMS (after PopMark).
  Result<Value*> TargetBelowMark() {
    if (stack_.size() <= Fence()) return Corrupt("stack underflow");
    return stack_.back();
  }

  // The memo: CPython numbers entries 0, 1, 2, ..., so indices near the count live in a
  // vector; far-off ones (only a crafted pickle has them) in a map, so that one huge index
  // cannot force a huge allocation.
  Status Memoize(uint64_t index) {
    UCP_ASSIGN_OR_RETURN(Value * top, Top());
    bool is_new;
    if (index < memo_dense_.size() || index < 2 * memo_count_ + 4096) {
      if (index >= memo_dense_.size()) memo_dense_.resize(index + 1, nullptr);
      is_new =
          memo_dense_[index] == nullptr && (memo_sparse_.empty() || memo_sparse_.erase(index) == 0);
      memo_dense_[index] = top;
    } else {
      is_new = memo_sparse_.insert_or_assign(index, top).second;
    }
    if (is_new && ++memo_count_ > limits_.max_memo) {
      return Fail(StatusCode::kOutOfRange,
                  "memo over " + std::to_string(limits_.max_memo) + " entries");
    }
    return Status::Ok();
  }

  Status Recall(uint64_t index) {
    if (index < memo_dense_.size() && memo_dense_[index] != nullptr) {
      return Push(memo_dense_[index]);
    }
    auto it = memo_sparse_.find(index);
    if (it == memo_sparse_.end()) return Corrupt("memo key " + std::to_string(index) + " missing");
    return Push(it->second);
  }

  // ---- the dispatch ----

  Status Step() {
    switch (op_) {
      case 0x80: {  // PROTO
        UCP_ASSIGN_OR_RETURN(uint64_t proto, ReadUnsigned(1));
        if (proto > 5) {
          return Fail(StatusCode::kUnsupported, "protocol " + std::to_string(proto));
        }
        return Status::Ok();
      }
      case 0x95: {  // FRAME: a read-ahead hint; only its extent is checked, as CPython does.
        UCP_ASSIGN_OR_RETURN(uint64_t size, ReadUnsigned(8));
        if (size > in_.size() - pos_) return Corrupt("truncated input: frame past the end");
        return Status::Ok();
      }
      case '(':
        if (marks_.size() >= limits_.max_marks) {
          return Fail(StatusCode::kOutOfRange,
                      "more than " + std::to_string(limits_.max_marks) + " marks");
        }
        marks_.push_back(stack_.size());
        return Status::Ok();
      case '0':  // POP: the C unpickler pops a mark sitting on top of the stack instead.
        if (!marks_.empty() && marks_.back() == stack_.size()) {
          marks_.pop_back();
          return Status::Ok();
        }
        return Pop().status();
      case '1':
        return PopMark().status();
      case '2': {
        UCP_ASSIGN_OR_RETURN(Value * top, Top());
        return Push(top);
      }
      case 'N':
        return Push(graph_.None());
      case 0x88:
        return Push(graph_.Bool(true));
      case 0x89:
        return Push(graph_.Bool(false));
      case 'J': {
        UCP_ASSIGN_OR_RETURN(int32_t v, ReadInt32());
        return Push(graph_.Int(v));
      }
      case 'K':
      case 'M': {
        UCP_ASSIGN_OR_RETURN(uint64_t v, ReadUnsigned(op_ == 'K' ? 1 : 2));
        return Push(graph_.Int(static_cast<int64_t>(v)));
      }
      case 0x8a:
      case 0x8b: {
        UCP_ASSIGN_OR_RETURN(uint64_t n, ReadLength(op_ == 0x8a ? 1 : 4, op_ == 0x8b));
        UCP_ASSIGN_OR_RETURN(std::string_view b, Read(n));
        return Push(graph_.IntFromBytes(b));
      }
      case 'I': {
        UCP_ASSIGN_OR_RETURN(std::string_view line, ReadLine());
        if (line == "00" || line == "01") return Push(graph_.Bool(line == "01"));
        return PushInt(line);
      }
      case 'L': {
        UCP_ASSIGN_OR_RETURN(std::string_view line, ReadLine());
        if (!line.empty() && line.back() == 'L') line.remove_suffix(1);
        return PushInt(line);
      }
      case 'G': {
        UCP_ASSIGN_OR_RETURN(std::string_view b, Read(8));
        uint64_t bits = 0;
        for (size_t i = 0; i < 8; ++i) bits = (bits << 8) | static_cast<uint8_t>(b[i]);
        double d;
        std::memcpy(&d, &bits, sizeof(d));
        return Push(graph_.Float(d));
      }
      case 'F': {
        UCP_ASSIGN_OR_RETURN(std::string_view line, ReadLine());
        std::string_view text = line;
        if (!text.empty() && text[0] == '+') text.remove_prefix(1);
        double d = 0;
        const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), d);
        if (text.empty() || ptr != text.data() + text.size() ||
            (ec != std::errc() && ec != std::errc::result_out_of_range)) {
          return Corrupt("malformed float text");
        }
        return Push(graph_.Float(d));
      }
      case 'X':
      case 0x8c:
      case 0x8d: {
        const size_t width = op_ == 0x8c ? 1 : op_ == 'X' ? 4 : 8;
        UCP_ASSIGN_OR_RETURN(uint64_t n, ReadLength(width, false));
        UCP_ASSIGN_OR_RETURN(std::string_view b, Read(n));
        return PushStr(std::string(b), true);
      }
      case 'V': {
        UCP_ASSIGN_OR_RETURN(std::string_view line, ReadLine());
        auto text = DecodeRawUnicodeEscape(line);
        if (!text) return Corrupt("malformed \\u escape");
        return PushStr(std::move(*text), true);
      }
      case 'T':
      case 'U': {
        UCP_ASSIGN_OR_RETURN(uint64_t n, ReadLength(op_ == 'U' ? 1 : 4, op_ == 'T'));
        UCP_ASSIGN_OR_RETURN(std::string_view b, Read(n));
        return PushStr(std::string(b), false);
      }
      case 'S': {
        UCP_ASSIGN_OR_RETURN(std::string_view line, ReadLine());
        if (line.size() < 2 || line.front() != line.back() ||
            (line.front() != '\'' && line.front() != '"')) {
          return Corrupt("the STRING argument must be quoted");
        }
        auto bytes = DecodeEscapedString(line.substr(1, line.size() - 2));
        if (!bytes) return Corrupt("malformed escape");
        return PushStr(std::move(*bytes), false);
      }
      case 'B':
      case 'C':
      case 0x8e:
      case 0x96: {
        const size_t width = op_ == 'C' ? 1 : op_ == 'B' ? 4 : 8;
        UCP_ASSIGN_OR_RETURN(uint64_t n, ReadLength(width, false));
        UCP_ASSIGN_OR_RETURN(std::string_view b, Read(n));
        return Push(op_ == 0x96 ? graph_.ByteArray(std::string(b)) : graph_.Bytes(std::string(b)));
      }
      case ')':
        return Push(graph_.Tuple({}));
      case 0x85:
      case 0x86:
      case 0x87: {
        const size_t n = op_ - 0x84u;
        if (stack_.size() < Fence() + n) return Corrupt("stack underflow");
        std::vector<Value*> items(stack_.end() - static_cast<ptrdiff_t>(n), stack_.end());
        stack_.resize(stack_.size() - n);
        return PushSequence(Kind::kTuple, std::move(items));
      }
      case 't': {
        UCP_ASSIGN_OR_RETURN(auto items, PopMark());
        return PushSequence(Kind::kTuple, std::move(items));
      }
      case ']':
        return Push(graph_.List({}));
      case 'l': {
        UCP_ASSIGN_OR_RETURN(auto items, PopMark());
        return PushSequence(Kind::kList, std::move(items));
      }
      case '}':
        return Push(graph_.Dict({}));
      case 'd': {
        UCP_ASSIGN_OR_RETURN(auto items, PopMark());
        return PushDict(items);
      }
      case 0x8f:
        return Push(graph_.Set({}));
      case 0x91: {
        UCP_ASSIGN_OR_RETURN(auto items, PopMark());
        return PushSequence(Kind::kFrozenSet, std::move(items));
      }
      case 0x90: {
        UCP_ASSIGN_OR_RETURN(auto items, PopMark());
        UCP_ASSIGN_OR_RETURN(Value * target, TargetBelowMark());
        if (target->kind() != Kind::kSet) {
          return Fail(
              target->kind() == Kind::kObject ? StatusCode::kUnsupported : StatusCode::kCorrupt,
              "target is " + std::string(KindName(target->kind())));
        }
        for (Value* item : items) {
          UCP_RETURN_IF_ERROR(Contain(target, item));
          target->mutable_items().push_back(item);
        }
        return Status::Ok();
      }
      case 'a': {
        UCP_ASSIGN_OR_RETURN(Value * item, Pop());
        UCP_ASSIGN_OR_RETURN(Value * target, Top());
        return Append(target, {item});
      }
      case 'e': {
        UCP_ASSIGN_OR_RETURN(auto items, PopMark());
        UCP_ASSIGN_OR_RETURN(Value * target, TargetBelowMark());
        return Append(target, items);
      }
      case 's': {
        UCP_ASSIGN_OR_RETURN(Value * value, Pop());
        UCP_ASSIGN_OR_RETURN(Value * key, Pop());
        UCP_ASSIGN_OR_RETURN(Value * target, Top());
        return SetItems(target, {key, value});
      }
      case 'u': {
        UCP_ASSIGN_OR_RETURN(auto items, PopMark());
        UCP_ASSIGN_OR_RETURN(Value * target, TargetBelowMark());
        return SetItems(target, items);
      }
      case 'p': {
        UCP_ASSIGN_OR_RETURN(std::string_view line, ReadLine());
        UCP_ASSIGN_OR_RETURN(uint64_t index, ParseIndex(line));
        return Memoize(index);
      }
      case 'q':
      case 'r': {
        UCP_ASSIGN_OR_RETURN(uint64_t index, ReadUnsigned(op_ == 'q' ? 1 : 4));
        return Memoize(index);
      }
      case 0x94:
        return Memoize(memo_count_);
      case 'g': {
        UCP_ASSIGN_OR_RETURN(std::string_view line, ReadLine());
        UCP_ASSIGN_OR_RETURN(uint64_t index, ParseIndex(line));
        return Recall(index);
      }
      case 'h':
      case 'j': {
        UCP_ASSIGN_OR_RETURN(uint64_t index, ReadUnsigned(op_ == 'h' ? 1 : 4));
        return Recall(index);
      }
      case 'c': {
        UCP_ASSIGN_OR_RETURN(std::string_view module, ReadLine());
        UCP_ASSIGN_OR_RETURN(std::string_view name, ReadLine());
        return PushGlobal(module, name);
      }
      case 0x93: {
        UCP_ASSIGN_OR_RETURN(Value * name, Pop());
        UCP_ASSIGN_OR_RETURN(Value * module, Pop());
        if (name->kind() != Kind::kStr || module->kind() != Kind::kStr) {
          return Corrupt("module and name must be strs");
        }
        return PushGlobal(module->data(), name->data());
      }
      case 0x82:
      case 0x83:
      case 0x84: {
        int64_t code;
        if (op_ == 0x84) {
          UCP_ASSIGN_OR_RETURN(int32_t c, ReadInt32());
          code = c;
        } else {
          UCP_ASSIGN_OR_RETURN(uint64_t c, ReadUnsigned(op_ == 0x82 ? 1 : 2));
          code = static_cast<int64_t>(c);
        }
        if (code <= 0) return Corrupt("extension code " + std::to_string(code) + " <= 0");
        return Push(graph_.Extension(static_cast<int32_t>(code)));
      }
      case 'R': {
        UCP_ASSIGN_OR_RETURN(Value * args, Pop());
        UCP_ASSIGN_OR_RETURN(Value * callable, Pop());
        return PushObject(Construction::kReduce, callable, args, nullptr);
      }
      case 0x81: {
        UCP_ASSIGN_OR_RETURN(Value * args, Pop());
        UCP_ASSIGN_OR_RETURN(Value * cls, Pop());
        return PushObject(Construction::kNewObj, cls, args, nullptr);
      }
      case 0x92: {
        UCP_ASSIGN_OR_RETURN(Value * kwargs, Pop());
        UCP_ASSIGN_OR_RETURN(Value * args, Pop());
        UCP_ASSIGN_OR_RETURN(Value * cls, Pop());
        return PushObject(Construction::kNewObjEx, cls, args, kwargs);
      }
      case 'i': {
        UCP_ASSIGN_OR_RETURN(std::string_view module, ReadLine());
        UCP_ASSIGN_OR_RETURN(std::string_view name, ReadLine());
        UCP_ASSIGN_OR_RETURN(auto items, PopMark());
        UCP_RETURN_IF_ERROR(PushGlobal(module, name));
        Value* cls = stack_.back();
        stack_.pop_back();
        Value* args = graph_.Tuple(std::move(items));
        UCP_RETURN_IF_ERROR(ContainAll(args, args->items()));
        return PushObject(Construction::kInst, cls, args, nullptr);
      }
      case 'o': {
        UCP_ASSIGN_OR_RETURN(auto items, PopMark());
        if (items.empty()) return Corrupt("no class in the marked items");
        Value* cls = items.front();
        Value* args = graph_.Tuple(std::vector<Value*>(items.begin() + 1, items.end()));
        UCP_RETURN_IF_ERROR(ContainAll(args, args->items()));
        return PushObject(Construction::kObj, cls, args, nullptr);
      }
      case 'b': {
        UCP_ASSIGN_OR_RETURN(Value * state, Pop());
        UCP_ASSIGN_OR_RETURN(Value * target, Top());
        if (target->kind() != Kind::kObject) {
          return Fail(target->kind() == Kind::kGlobal || target->kind() == Kind::kPersistentId ||
                              target->kind() == Kind::kExtension
                          ? StatusCode::kUnsupported
                          : StatusCode::kCorrupt,
                      "target is " + std::string(KindName(target->kind())));
        }
        UCP_RETURN_IF_ERROR(Contain(target, state));
        target->mutable_mutations().push_back({Mutation::Op::kBuild, state, nullptr});
        return Status::Ok();
      }
      case 'P': {
        UCP_ASSIGN_OR_RETURN(std::string_view line, ReadLine());
        if (std::any_of(line.begin(), line.end(), [](char c) { return (c & 0x80) != 0; })) {
          return Corrupt("persistent id is not ASCII");
        }
        Value* pid = graph_.Str(std::string(line));
        Value* v = graph_.PersistentId(pid);
        return Push(v);
      }
      case 'Q': {
        UCP_ASSIGN_OR_RETURN(Value * pid, Pop());
        Value* v = graph_.PersistentId(pid);
        depth_[v] = 1;
        UCP_RETURN_IF_ERROR(Contain(v, pid));
        return Push(v);
      }
      case 0x97:
      case 0x98:
        return Fail(StatusCode::kUnsupported, "out-of-band buffers are not supported");
      default: {
        static constexpr char kHex[] = "0123456789abcdef";
        return Corrupt(std::string("unknown opcode 0x") + kHex[op_ >> 4] + kHex[op_ & 0xf]);
      }
    }
  }

  std::string_view in_;
  std::string name_;
  ReadLimits limits_;
  size_t pos_ = 0;
  size_t op_offset_ = 0;
  uint8_t op_ = 0;
  Graph graph_;
  std::vector<Value*> stack_;
  std::vector<size_t> marks_;
  std::vector<Value*> memo_dense_;
  std::unordered_map<uint64_t, Value*> memo_sparse_;
  uint64_t memo_count_ = 0;  // distinct indices, as len(memo) in Python
  NodeMap<uint32_t> depth_;  // container nesting as built (ReadLimits::max_depth)
};

}  // namespace

Result<Graph> ReadPickle(std::string_view bytes, const ReadOptions& options) {
  return Unpickler(bytes, options).Run();
}

}  // namespace ucp::pickle
